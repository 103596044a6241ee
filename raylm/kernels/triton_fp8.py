"""Quantizing to FP8 in Triton: the scale and rounding every kernel that quantizes shares (fp8_scale, to_fp8: the
KV-cache writes, the decode GEMV's FP8 input), and activations quantized per token in one kernel, for the FP8
matmul's input (kernels/fp8.py).

kernels/fp8.py's quantize_fp8 in torch takes about seven kernels and a float32 copy of the input (cast, abs, amax,
divide, clamp, divide, cast); here one program per row reads the row twice (its amax, then its values, the second
time mostly from L2) and writes the FP8 row and its scale: the same bytes, the divisions rounded as torch rounds
them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.fp8 import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)
_BLOCK_K = 1024
_MIN_TILE_AMAX = tl.constexpr(2.0 ** -60)
_INVERSE_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)


# Divisions are rounded as torch rounds them (Triton's `/` is the GPU's approximate one), so kernels quantize to the
# bytes kernels/fp8.py's quantize_fp8 gives.
@triton.jit
def fp8_scale(amax):
    """The scale of values whose largest magnitude is amax: amax / 448, the smallest normal float32 for zeros."""
    return tl.maximum(tl.div_rn(amax, _FP8_MAX), _MIN_SCALE)


@triton.jit
def tile_scale(amax):
    """(scale, inverse) for a tile of values whose largest magnitude is amax (held at 2^-60 or more): inverse =
    448 / amax, rounded correctly, which the values are multiplied by (the amax lands on 448, FP8's largest value, so
    the largest value of the tile is kept exactly), and scale = amax x (1 / 448), a product, which the tile's sums are
    multiplied by. One division a row of the tile, not one a value."""
    amax = tl.maximum(amax, _MIN_TILE_AMAX)
    return amax * _INVERSE_FP8_MAX, tl.div_rn(_FP8_MAX, amax)


@triton.jit
def divide_by_scale(values, scale):
    """float32 values divided by a scale (a positive normal float32, broadcast over them), rounded correctly as
    torch's division rounds: from the scale's reciprocal (one division a scale) and one FMA correction a value
    (Markstein's theorem: a quotient within an ulp, corrected by the reciprocal times its exact remainder, rounds
    correctly). A product and two FMAs a value, not a division's ~10 instructions and its slow-path branch (sm_90:
    the SiLU-and-mul into FP8 rows loses a fifth of its instructions)."""
    inverse = tl.div_rn(1.0, scale)
    quotient = values * inverse
    # the remainder negated (quotient * scale - values, exact), so that -0.0 keeps its sign: torch gives -0.0 / s = -0.0
    return tl.fma(-tl.fma(quotient, scale, -values), inverse, quotient)


@triton.jit
def to_fp8(values, scale):
    """float32 values divided by their scale (divide_by_scale), in float8_e4m3fn (within ±448: the rounding
    saturates)."""
    return tl.clamp(divide_by_scale(values, scale), -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_out, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)))
    scale = fp8_scale(tl.max(amax, axis=0))
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, to_fp8(values, scale), mask=cols < K)
    tl.store(scale_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8(x) for x [M, K] (any float dtype, a contiguous last dimension): (FP8 [M, K], float32 scales
    [M]), each row scaled by its amax / 448."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8 takes [M, K] rows with a contiguous last dimension, got "
                         f"{list(x.shape)} with strides {x.stride()}")
    rows, K = x.shape
    out = torch.empty((rows, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, out, scale, K, x.stride(0), out.stride(0),
                                       BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(K)), num_warps=4)
    return out, scale
