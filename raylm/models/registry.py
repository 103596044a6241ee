"""Which model class serves which HF `architectures` entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from raylm.models.arch import ArchConfig, arch_from_hf
from raylm.models.bert import BertModel, EncoderArch, encoder_arch_from_hf
from raylm.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class ModelEntry:
    model_class: type[nn.Module]
    qkv_bias: bool = False
    qk_norm: bool = False
    encoder_only: bool = False  # attends both ways: it encodes prompts (encode_only engines) and cannot generate


_REGISTRY: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry(LlamaForCausalLM),
    "MistralForCausalLM": ModelEntry(LlamaForCausalLM),
    "Qwen2ForCausalLM": ModelEntry(LlamaForCausalLM, qkv_bias=True),
    "Qwen3ForCausalLM": ModelEntry(LlamaForCausalLM, qk_norm=True),
    "Qwen3MoeForCausalLM": ModelEntry(LlamaForCausalLM, qk_norm=True),
    "BertModel": ModelEntry(BertModel, encoder_only=True),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def resolve_architecture(hf_config: Any) -> tuple[ModelEntry, ArchConfig | EncoderArch]:
    """Picks the model class for an HF config; an unsupported architecture lists the supported ones."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) == "llama":
        names = ["LlamaForCausalLM"]
    for name in names:
        if name in _REGISTRY:
            entry = _REGISTRY[name]
            if entry.encoder_only:
                return entry, encoder_arch_from_hf(hf_config, name)
            return entry, arch_from_hf(hf_config, name, qkv_bias=entry.qkv_bias, qk_norm=entry.qk_norm)
    raise ValueError(
        f"model architecture {names or '(none given)'} is not supported; supported: "
        f"{', '.join(supported_architectures())}"
    )
