"""FP8 weights: which models have them (quant_config, or a checkpoint quantized already) and how checkpoint tensors
become them.

A quantized model stores each linear weight of its decoder layers (attention projections, MLP and expert
projections) as float8_e4m3fn with one float32 scale per output row, whatever the checkpoint's granularity: a
per-tensor scale is given to every row of its tensor, so fused projections (qkv, gate_up) hold their parts' scales
side by side and tensor-parallel shards split scales exactly as they split rows. Embeddings, the LM head, the MoE
router, norms and biases stay in the model's dtype.

Checkpoints in the model's dtype (and dummy weights) are quantized as they load. Checkpoints already in FP8 load as
they are, detected from config.json's quantization_config: transformers' fine-grained FP8 (quant_method "fp8",
scales `weight_scale_inv`, per tensor or per row) and compressed-tensors (quant_method "compressed-tensors",
format "float-quantized", `weight_scale` per tensor or per channel). Activations are always quantized per token at
run time, so a checkpoint's static activation scales (`input_scale`, `activation_scale`) are not used. A
compressed-tensors checkpoint whose kv_cache_scheme is FP8 turns the FP8 KV cache on (unless kv_cache_config.dtype
says otherwise). Its static KV scales (kv_tensor_scale) are what an FP8 cache with per-tensor scales divides by
(kv_cache_config.fp8_scales 'per_tensor', or 'auto', the default, where every layer has them); without them the cache
scales each token and head itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raylm.config import QuantConfig
from raylm.kernels.fp8 import FP8_DTYPE, quantize_fp8

# Checkpoint tensors a quantized model has no use for: static activation scales (activations are scaled per token).
UNUSED_SUFFIXES = (".input_scale", ".activation_scale", ".output_scale")
# An attention layer's static KV-cache scales under the names FP8-KV checkpoints give them: which of keys ("k") and
# values ("v") each scales.
_KV_SCALE_SUFFIXES = {".self_attn.k_scale": "k", ".self_attn.v_scale": "v", ".self_attn.kv_scale": "kv",
                      ".self_attn.k_proj.output_scale": "k", ".self_attn.v_proj.output_scale": "v"}
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # the dequantizing multiplier, under either name


@dataclass(frozen=True)
class Fp8Weights:
    """A model's FP8 weights: how weights quantized at load time are scaled (per_tensor: one amax per weight matrix;
    else per output row), the checkpoint's quant_method when it holds FP8 weights already (None: it does not), and
    whether the checkpoint was made for an FP8 KV cache (its kv_cache_scheme)."""

    per_tensor: bool = False
    checkpoint_method: str | None = None
    kv_cache: bool = False


def kv_tensor_scale(name: str, tensor) -> tuple[str, str, float] | None:
    """(the attention module's name, "k" / "v" / "kv", the scale) when `name` is a static KV-cache scale, else None.
    A scale is one positive number (per tensor); a scale of another shape (per head, per channel) is a ValueError."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            values = tensor[...].float().reshape(-1)
            if values.numel() != 1 or not values.item() > 0:
                raise ValueError(f"checkpoint tensor {name!r} must be one positive KV-cache scale (per tensor), got "
                                 f"shape {list(getattr(tensor, 'shape', ()))}")
            return name.removesuffix(suffix) + ".self_attn", which, float(values.item())
    return None


def resolve_fp8_weights(quant_config: QuantConfig, hf_config: Any) -> Fp8Weights | None:
    """The model's FP8 weights from quant_config and the checkpoint's quantization_config, or None for weights in
    the model's dtype. A checkpoint in FP8 implies quant_algo="FP8"; a quantization raylm does not load, or a
    weight_scale set against the checkpoint's own, is a ValueError."""
    method, granularity, kv_cache = _checkpoint_fp8(hf_config)
    if method is None:
        if quant_config.quant_algo is None:
            return None
        return Fp8Weights(per_tensor=quant_config.weight_scale == "per_tensor")
    if "weight_scale" in quant_config.model_fields_set and granularity not in (None, quant_config.weight_scale):
        raise ValueError(f"quant_config.weight_scale is {quant_config.weight_scale!r} but the checkpoint's FP8 "
                         f"weights are scaled {granularity} ({method})")
    return Fp8Weights(per_tensor=granularity == "per_tensor", checkpoint_method=method, kv_cache=kv_cache)


def _checkpoint_fp8(hf_config: Any) -> tuple[str | None, str | None, bool]:
    """(quant_method, granularity, FP8 KV cache) of a checkpoint in FP8; (None, None, False) for one that is not
    quantized. Granularity is 'per_tensor', 'per_channel', or None where parts of the model differ."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None, None, False
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method == "fp8":
        return method, _fine_grained_granularity(config), False
    if method == "compressed-tensors":
        return method, _compressed_tensors_granularity(config), _kv_cache_scheme_is_fp8(config)
    raise ValueError(f"the checkpoint's quantization_config.quant_method {method!r} is not supported; supported: "
                     "'fp8', 'compressed-tensors' (FP8 float-quantized)")


def _fine_grained_granularity(config: dict) -> str:
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or block[0] != 1):
        raise ValueError(f"quantization_config.weight_block_size {list(block)} (block-wise FP8 scales) is not "
                         "supported yet; supported: null (per tensor) or [1, n] (per row)")
    if config.get("scale_fmt", "float") != "float":
        raise ValueError(f"quantization_config.scale_fmt {config['scale_fmt']!r} is not supported; supported: 'float'")
    return "per_tensor" if block is None else "per_channel"


_STRATEGIES = {"tensor": "per_tensor", "channel": "per_channel"}


def _compressed_tensors_granularity(config: dict) -> str | None:
    if config.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors quantization_config.format {config.get('format')!r} is not supported; "
                         "supported: 'float-quantized' (FP8)")
    strategies = set()
    for group_name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors group {group_name!r} quantizes weights to {weights.get('type')} "
                             f"{weights.get('num_bits')} bits; supported: float 8 bits (FP8)")
        strategy = weights.get("strategy")
        if strategy not in _STRATEGIES:
            raise ValueError(f"compressed-tensors group {group_name!r} has weight strategy {strategy!r}; supported: "
                             f"{', '.join(_STRATEGIES)}")
        strategies.add(_STRATEGIES[strategy])
    if not strategies:
        raise ValueError("the checkpoint's compressed-tensors quantization_config has no config_groups")
    return strategies.pop() if len(strategies) == 1 else None


def _kv_cache_scheme_is_fp8(config: dict) -> bool:
    scheme = config.get("kv_cache_scheme")
    if not scheme:
        return False
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8:
        raise ValueError(f"the checkpoint's quantization_config.kv_cache_scheme quantizes the KV cache to "
                         f"{scheme.get('type')} {scheme.get('num_bits')} bits; supported: float 8 bits (FP8)")
    return True


def split_scale_name(name: str) -> tuple[str, bool]:
    """(the weight's name, True) for a weight's scale (`X.weight_scale` or `X.weight_scale_inv`); (name, False) for
    anything else."""
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight", True
    return name, False


def scale_param_name(param_name: str) -> str:
    """The scale parameter of an FP8 weight parameter: `X.weight` -> `X.weight_scale`, an expert stack `X.w13` ->
    `X.w13_scale`."""
    return f"{param_name}_scale"


class UniformScale:
    """A per-tensor scale read as per-row scales: every row it is narrowed to has the one value."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.value.expand(length)

    def __getitem__(self, index) -> torch.Tensor:
        return self.value


def checkpoint_scale(name: str, tensor: Any) -> torch.Tensor | UniformScale:
    """A checkpoint's weight scale as per-row float32 scales ([rows]), or a UniformScale for a per-tensor one."""
    scale = tensor[...].float()
    if scale.numel() == 1:
        return UniformScale(scale.reshape(()))
    if scale.dim() == 1 or (scale.dim() == 2 and scale.shape[1] == 1):
        return scale.reshape(-1)
    raise ValueError(f"checkpoint tensor {name!r} of shape {list(scale.shape)} is neither a per-tensor nor a per-row "
                     "scale (block-wise FP8 scales are not supported yet)")


def is_fp8(tensor: Any) -> bool:
    """Whether a checkpoint tensor holds float8_e4m3fn values (float8_e5m2 ones are refused)."""
    if tensor.dtype == torch.float8_e5m2:
        raise ValueError("float8_e5m2 checkpoint weights are not supported; supported: float8_e4m3fn")
    return tensor.dtype == FP8_DTYPE


def quantize_checkpoint_weight(tensor: Any, device: torch.device, per_tensor: bool,
                               stacked_gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole checkpoint weight (in the model's dtype) quantized on `device`: (FP8 values, per-row scales). The
    whole tensor, not this rank's shard, so a row split across ranks (row parallelism) has one scale on each.
    stacked_gate_up: an experts' [E, 2I, H] stack, whose gate and up halves are matrices of their own (per_tensor
    scales them apart, as if they came one expert's projection at a time)."""
    full = tensor[...].to(device)
    if stacked_gate_up and per_tensor:
        quantized, scale = quantize_fp8(full.unflatten(1, (2, -1)), per_tensor=True)
        return quantized.flatten(1, 2), scale.flatten(1, 2)
    return quantize_fp8(full, per_tensor)
