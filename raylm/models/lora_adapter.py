"""PEFT-format LoRA adapters: reading adapter_config.json and adapter_model.safetensors, and checking that an
adapter fits the model and what raylm's LoRA layers do (models/lora.py). The driver checks an adapter before it
submits a request with it, so a bad adapter is refused with a ValueError that says what is wrong; the workers
read the same files the same way. An adapter handed over in memory (its config dict and state dict) is checked
the same way."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raylm.models.arch import ArchConfig

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES

# PEFT's name of a LoRA matrix: ...layers.<L>.<self_attn|mlp>.<projection>.lora_<A|B>.weight
_TENSOR_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")

# adapter_config.json fields that change what the adapter computes beyond x A^T B^T * scaling: refused when set.
_UNSUPPORTED_WHEN_SET = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "target_parameters": "adapted parameters (target_parameters)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "layer replication (layer_replication)",
}

ModuleKey = tuple[int, str]  # (decoder layer index, PEFT projection name such as "q_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter's files say: its rank, the factor its product is scaled by, and the modules it adapts."""

    path: str
    rank: int
    scaling: float
    modules: tuple[ModuleKey, ...]


def _config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json is not valid JSON ({exc})") from exc


def _weights_file(path: Path) -> Path:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_model.safetensors")
    return weights


def _expected_shape(arch: ArchConfig, module: str) -> tuple[int, int]:
    """(output features, input features) of a projection of the full (unsharded) model."""
    q_out, kv_out = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (q_out, arch.hidden_size),
        "k_proj": (kv_out, arch.hidden_size),
        "v_proj": (kv_out, arch.hidden_size),
        "o_proj": (arch.hidden_size, q_out),
        "gate_proj": (arch.intermediate_size, arch.hidden_size),
        "up_proj": (arch.intermediate_size, arch.hidden_size),
        "down_proj": (arch.hidden_size, arch.intermediate_size),
    }[module]


def _check_config(source: str, config: dict, max_rank: int) -> tuple[int, float]:
    """The rank and scaling of an adapter whose config raylm can serve; a ValueError naming what it cannot."""
    where = f"LoRA adapter {source!r}"
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type must be 'LORA', got {config.get('peft_type')!r}")
    for key, what in _UNSUPPORTED_WHEN_SET.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported, got {key}={config[key]!r}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases are not supported: bias must be 'none', got {config['bias']!r}")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple, set, frozenset)):  # a set in a PEFT config object's to_dict()
        unsupported = sorted(set(targets) - set(SUPPORTED_MODULES))
        if unsupported:
            raise ValueError(f"{where}: target_modules {unsupported} are not supported; supported: "
                             f"{list(SUPPORTED_MODULES)}")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank r={rank} exceeds lora_config.max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _check_tensors(source: str, shapes: dict[str, tuple[int, ...]], arch: ArchConfig,
                   rank: int) -> tuple[ModuleKey, ...]:
    """The (layer, module) pairs the tensors adapt; a ValueError for a tensor raylm cannot apply or a shape that does
    not fit the model."""
    where = f"LoRA adapter {source!r}"
    found: dict[ModuleKey, set[str]] = {}
    for name, shape in shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ValueError(f"{where}: tensor {name!r} is not a LoRA matrix of a supported module "
                             f"({', '.join(SUPPORTED_MODULES)})")
        layer, section, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in (ATTENTION_MODULES if section == "self_attn" else MLP_MODULES):
            raise ValueError(f"{where}: tensor {name!r} adapts {section}.{module}, which is not supported")
        if layer >= arch.num_layers:
            raise ValueError(f"{where}: tensor {name!r} adapts layer {layer}, but the model has {arch.num_layers}")
        if section == "mlp" and arch.is_moe_layer(layer):
            raise ValueError(f"{where}: tensor {name!r} adapts the mixture-of-experts MLP of layer {layer}, which is "
                             "not supported")
        out_features, in_features = _expected_shape(arch, module)
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(shape) != expected:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(shape)}, expected {expected} (r={rank})")
        found.setdefault((layer, module), set()).add(which)
    lonely = sorted(key for key, halves in found.items() if halves != {"A", "B"})
    if lonely:
        layer, module = lonely[0]
        raise ValueError(f"{where}: layer {layer} {module} has lora_A or lora_B but not both")
    if not found:
        raise ValueError(f"{where}: the adapter holds no LoRA matrices")
    return tuple(sorted(found))


def check_adapter(path: str | Path, arch: ArchConfig, max_rank: int) -> AdapterSpec:
    """Reads an adapter's config and its tensors' names and shapes (not their values) and checks that raylm can
    apply it to a model of `arch`: a ValueError says what is wrong otherwise."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r} is not a directory")
    rank, scaling = _check_config(str(path), _config(path), max_rank)
    with safe_open(str(_weights_file(path)), framework="pt", device="cpu") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    return AdapterSpec(str(path), rank, scaling, _check_tensors(str(path), shapes, arch, rank))


def check_adapter_in_memory(name: str, config: Mapping[str, Any], tensors: Mapping[str, Any], arch: ArchConfig,
                            max_rank: int) -> AdapterSpec:
    """check_adapter for an adapter handed over in memory: PEFT's config as a dict and its state dict."""
    where = f"<in memory: {name}>"
    rank, scaling = _check_config(where, dict(config), max_rank)
    not_tensors = sorted(key for key, value in tensors.items() if not isinstance(value, torch.Tensor))
    if not_tensors:
        raise ValueError(f"LoRA adapter {where!r}: lora_tensors must map names to torch tensors, got "
                         f"{type(tensors[not_tensors[0]]).__name__} for {not_tensors[0]!r}")
    shapes = {key: tuple(value.shape) for key, value in tensors.items()}
    return AdapterSpec(where, rank, scaling, _check_tensors(where, shapes, arch, rank))


def read_adapter(path: str | Path, arch: ArchConfig, max_rank: int,
                 dtype: torch.dtype) -> tuple[AdapterSpec, dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]]:
    """An adapter's spec and its matrices, (A [r, in], B [out, r] with the scaling folded in) per (layer, module),
    in `dtype` on the CPU; checked as check_adapter does."""
    from safetensors.torch import load_file

    spec = check_adapter(path, arch, max_rank)
    return spec, adapter_matrices(spec, load_file(str(_weights_file(Path(path)))), dtype)


def adapter_matrices(spec: AdapterSpec, tensors: Mapping[str, torch.Tensor],
                     dtype: torch.dtype) -> dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]:
    """The checked adapter's matrices, (A [r, in], B [out, r] with the scaling folded in) per (layer, module), in
    `dtype` on the CPU (copies: the caller's tensors stay as they are)."""
    matrices: dict[ModuleKey, list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        key = (int(match[1]), match[3])
        matrices.setdefault(key, [None, None])["AB".index(match[4])] = tensor.detach().cpu()
    return {key: (a.to(dtype, copy=True), (b.float() * spec.scaling).to(dtype)) for key, (a, b) in matrices.items()}
