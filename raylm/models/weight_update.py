"""New weights for a loaded model, under their checkpoint (HF) names: checked whole before any is copied, so a
bad update leaves the old weights serving; then copied in place through the model's own loaders (fused and
sharded parameters), so device addresses, and the CUDA graphs captured over them, stay valid."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def checkpoint_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and full (unsharded) shapes for `hf_config`, read off transformers' model
    built on the meta device (nothing allocated); tied weights under each of their names."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(param.shape) for name, param in reference.named_parameters(remove_duplicate=False)}


def check_update(named: list[tuple[str, Any]], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 architecture: str) -> None:
    """Raises (TypeError / ValueError naming the tensor) unless every entry is a tensor of a checkpoint name, of
    its full shape and of the engine's dtype."""
    for name, tensor in named:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"update_weights takes (name, tensor) pairs, got ({type(name).__name__}, "
                            f"{type(tensor).__name__})")
        expected = shapes.get(name)
        if expected is None:
            raise ValueError(f"update_weights: {name!r} is not a weight of {architecture}")
        if tuple(tensor.shape) != expected:
            raise ValueError(f"update_weights: {name!r} has shape {list(tensor.shape)}, expected {list(expected)}")
        if tensor.dtype != dtype:
            raise ValueError(f"update_weights: {name!r} is {tensor.dtype}, the engine's weights are {dtype}")


@torch.inference_mode()
def apply_update(model: nn.Module, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copies checked tensors into this rank's parameters (its shards and stage); returns how many it took."""
    return len(model.load_weights(named))
