"""Linear layers' matmul: cuBLAS (F.linear), or the Triton GEMV for decode-sized inputs where the model's kernel
policy says so (kernels/policy.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylm.kernels.policy import KernelPolicy


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, policy: KernelPolicy) -> torch.Tensor:
    """x @ weight.T + bias, through the Triton GEMV (kernels/triton_gemv.py) where policy.gemv_applies."""
    if policy.gemv_applies(x, weight):
        from raylm.kernels.triton_gemv import gemv

        return gemv(x, weight, bias, pdl=policy.pdl)
    return F.linear(x, weight, bias)
