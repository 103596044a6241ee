"""Which kernels run: the Triton ones for CUDA tensors when Triton imports (unless RAYLM_DISABLE_TRITON=1),
the torch reference otherwise. Linear layers use cuBLAS (F.linear), or for decode-sized inputs the Triton GEMV
when RAYLM_TRITON_GEMV=1."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

# The most rows (tokens) the decode GEMV kernel takes; larger inputs are matmuls, left to cuBLAS.
GEMV_MAX_ROWS = 8
_HALF = (torch.float16, torch.bfloat16)
# RAYLM_PDL's values and the trigger mode each selects (kernels/pdl.py; the kernels' USE_PDL constexpr, 0 is off).
PDL_TRIGGERS = {"0": 0, "": 0, "1": 1, "start": 1, "after_wait": 2, "exit": 3, "tail": 4}


def env_flag(name: str) -> bool:
    """Whether the switch `name` is set in the environment (anything but unset, empty or "0")."""
    return os.environ.get(name, "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    if env_flag("RAYLM_DISABLE_TRITON"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


@functools.cache
def triton_gemv_enabled() -> bool:
    return env_flag("RAYLM_TRITON_GEMV") and triton_available()


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x (at most GEMV_MAX_ROWS rows of half-precision input on CUDA) goes to the Triton GEMV, when
    RAYLM_TRITON_GEMV=1."""
    return (x.is_cuda and weight.dtype in _HALF and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]
            and x.dtype == weight.dtype and triton_gemv_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the Triton GEMV (kernels/triton_gemv.py) for a few rows of half-precision input on CUDA."""
    if gemv_applies(x, weight):
        from raylm.kernels.triton_gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
