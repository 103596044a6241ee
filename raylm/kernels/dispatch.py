"""Which kernels run: the Triton ones for CUDA tensors when Triton imports (unless RAYLM_DISABLE_TRITON=1),
the torch reference otherwise."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    if os.environ.get("RAYLM_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()
