"""Gated activations (torch reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylm.kernels.policy import KernelPolicy

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated_activation(name: str):
    """Returns f(gate_up, kernels) = act(gate) * up for a tensor holding gate and up side by side, through the
    Triton kernel where the kernel policy `kernels` has it."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    act = _ACTIVATIONS[name]

    def apply(gate_up: torch.Tensor, kernels: KernelPolicy = KernelPolicy()) -> torch.Tensor:
        if name == "silu" and kernels.on_triton(gate_up):
            from raylm.kernels.triton_ops import silu_and_mul

            return silu_and_mul(gate_up, kernels.pdl)
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up

    return apply
