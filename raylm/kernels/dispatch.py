"""Which kernels run: the Triton ones for CUDA tensors when Triton imports (unless RAYLM_DISABLE_TRITON=1),
the torch reference otherwise. Linear layers use cuBLAS (F.linear), or for decode-sized inputs the Triton GEMV.

The decode GEMV and programmatic dependent launch (kernels/pdl.py) pay off where a decode step streams its weights
(Llama-3.1-8B on the H200: 4.63 -> 4.45-4.47 ms/token at batch 1, level at batch 8) and cost where it waits on the
host (SmolLM2-135M: 1.13 -> 1.59 ms/token). So by default the model runner turns both on for models of at least
WEIGHT_STREAMING_BYTES of weights per rank (`set_weight_streaming`); RAYLM_TRITON_GEMV=0/1 and RAYLM_PDL=0/<mode>
override that choice. The choice is per process: the runner constructed last sets it."""

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
# Weights per rank from which a decode step counts as weight streaming: ~1 ms of reading them at ~4 TB/s, about
# the host's own work for a step, below which the step waits on the host (Llama-3.1-8B: 16 GB at TP=1, 8 GB at
# TP=2, both measured faster with the GEMV and PDL; SmolLM2-135M: 0.27 GB, measured slower).
WEIGHT_STREAMING_BYTES = 4 << 30
# The trigger mode of weight-streaming models (measured best on the H200, docs/benchmarks.md).
STREAMING_PDL_MODE = PDL_TRIGGERS["tail"]
_weight_streaming = False


def env_switch(name: str, default: bool) -> bool:
    """The switch `name` when set in the environment (off: empty or "0"; on: anything else), else `default`."""
    value = os.environ.get(name)
    return default if value is None else value not in ("", "0")


def env_flag(name: str) -> bool:
    """Whether the switch `name` is set on in the environment (off when unset)."""
    return env_switch(name, False)


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


def set_weight_streaming(on: bool) -> None:
    """The model runner's default for this process: whether decode steps stream weights (see the module's
    docstring), which turns on the decode GEMV and PDL unless RAYLM_TRITON_GEMV / RAYLM_PDL say otherwise."""
    global _weight_streaming
    _weight_streaming = on


def weight_streaming() -> bool:
    return _weight_streaming


def streams_weights(weight_bytes: int) -> bool:
    """Whether a model of weight_bytes per rank streams weights in its decode steps (WEIGHT_STREAMING_BYTES)."""
    return weight_bytes >= WEIGHT_STREAMING_BYTES


@functools.cache
def gemv_switch() -> bool | None:
    """RAYLM_TRITON_GEMV when set (read once per process; cache_clear() to read it again), else None."""
    value = os.environ.get("RAYLM_TRITON_GEMV")
    return None if value is None else value not in ("", "0")


def triton_gemv_enabled() -> bool:
    switch = gemv_switch()
    return (_weight_streaming if switch is None else switch) and triton_available()


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x (at most GEMV_MAX_ROWS rows of half-precision input on CUDA) goes to the Triton GEMV, when
    it is on (triton_gemv_enabled)."""
    return (x.is_cuda and weight.dtype in _HALF and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]
            and x.dtype == weight.dtype and triton_gemv_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the Triton GEMV (kernels/triton_gemv.py) for a few rows of half-precision input on CUDA."""
    if gemv_applies(x, weight):
        from raylm.kernels.triton_gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
