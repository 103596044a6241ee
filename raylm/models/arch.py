"""The shape of a decoder model, read once from its HF config into a plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from raylm.models.quantization import Fp8Weights


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ArchConfig:
    """Everything the model code needs to know about an architecture instance."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    torch_dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Qwen3-MoE): which layers route tokens to experts, and how.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # FP8 linear weights in the decoder layers (models/quantization.py), or None: the model's dtype throughout.
    fp8: Fp8Weights | None = None

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[index]

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V that one token occupies over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _rope_from_hf(hf_config: Any) -> RopeConfig:
    params = getattr(hf_config, "rope_parameters", None) or {}
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, linear, llama3")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
    )


def _eos_ids(hf_config: Any) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    if layer_types and any(t != "sliding_attention" for t in layer_types):
        raise ValueError("models mixing sliding-window and full-attention layers are not supported")
    return int(window)


def config_dtype(hf_config: Any) -> torch.dtype | None:
    """The checkpoint's dtype as the config states it (under either of its HF names)."""
    fields = vars(hf_config)
    dtype = fields.get("dtype") or fields.get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _moe_fields(hf_config: Any) -> dict:
    num_experts = int(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0) or 0)
    if not num_experts:
        return {}
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf_config.num_experts_per_tok),
        moe_intermediate_size=int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        moe_layers=layers,
    )


def arch_from_hf(hf_config: Any, architecture: str, qkv_bias: bool, qk_norm: bool) -> ArchConfig:
    """Reads an HF PretrainedConfig of the Llama / Qwen family (dense or mixture of experts)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchConfig(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 4096)),
        rope=_rope_from_hf(hf_config),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=qk_norm,
        sliding_window=_sliding_window(hf_config),
        hidden_act=getattr(hf_config, "hidden_act", "silu"),
        torch_dtype=config_dtype(hf_config),
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=_eos_ids(hf_config),
        **_moe_fields(hf_config),
    )
