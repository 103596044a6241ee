"""New weights for a loaded model, under their checkpoint (HF) names: checked whole before any is copied, so a
bad update leaves the old weights serving; then copied in place through the model's own loaders (fused and
sharded parameters), so device addresses, and the CUDA graphs captured over them, stay valid."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and full (unsharded) shapes for `hf_config`, read off transformers' model
    built on the meta device (nothing allocated); tied weights under each of their names. A mixture-of-experts
    layer's experts are there under both of their names (_per_expert_shapes)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    shapes = {}
    for name, param in reference.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(param.shape)
        shapes.update(_per_expert_shapes(name, tuple(param.shape)))
    return shapes


def _per_expert_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-expert names and shapes of the experts that transformers holds stacked: `*.experts.gate_up_proj`
    [E, 2I, H] (each expert's gate rows, then its up rows) and `*.experts.down_proj` [E, H, I]. A trainer holding
    transformers' model sends these; checkpoints on disk, and other trainers, name each expert's projections
    (`*.experts.E.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]). Empty for any other tensor."""
    prefix, _, projection = name.rpartition(".")
    if not prefix.endswith(".experts") or len(shape) != 3:
        return {}
    num_experts, rows, columns = shape
    if projection == "gate_up_proj":
        per_expert = {"gate_proj": (rows // 2, columns), "up_proj": (rows // 2, columns)}
    elif projection == "down_proj":
        per_expert = {"down_proj": (rows, columns)}
    else:
        return {}
    return {f"{prefix}.{expert}.{part}.weight": part_shape
            for expert in range(num_experts) for part, part_shape in per_expert.items()}


def check_entries(entries: list[tuple[str, tuple[int, ...], torch.dtype]], shapes: dict[str, tuple[int, ...]],
                  dtype: torch.dtype, architecture: str) -> None:
    """Raises a ValueError naming the first (name, shape, dtype) that is not a checkpoint name of its full shape
    and the engine's dtype."""
    for name, shape, entry_dtype in entries:
        expected = shapes.get(name)
        if expected is None:
            raise ValueError(f"update_weights: {name!r} is not a weight of {architecture}")
        if tuple(shape) != expected:
            raise ValueError(f"update_weights: {name!r} has shape {list(shape)}, expected {list(expected)}")
        if entry_dtype != dtype:
            raise ValueError(f"update_weights: {name!r} is {entry_dtype}, the engine's weights are {dtype}")


def check_update(named: list[tuple[str, Any]], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 architecture: str) -> None:
    """check_entries for (name, tensor) pairs, which must be just that (TypeError otherwise)."""
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights takes (name, tensor) pairs, got ({type(name).__name__}, "
                            f"{type(tensor).__name__})")
    check_entries([(name, tuple(tensor.shape), tensor.dtype) for name, tensor in named], shapes, dtype, architecture)


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {value!r}")
    return dtype


@torch.inference_mode()
def apply_update(model: nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copies checked tensors into this rank's parameters (its shards and stage); returns how many it took."""
    return len(model.load_weights(named))
