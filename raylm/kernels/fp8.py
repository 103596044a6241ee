"""FP8 (float8_e4m3fn) linear layers: weights stored in FP8 with a float32 scale per output row, activations
quantized per token at run time.

Two paths compute the same thing. The reference dequantizes both operands and multiplies in float32; it runs on the
CPU and is what the CUDA path is tested against. The CUDA path multiplies the FP8 operands directly with
torch._scaled_mm (compute capability 8.9+), which takes the weight column-major: the [out, in] row-major weight,
transposed as a view, is just that, so weights keep the layout of every other linear layer; its input is quantized
by one Triton kernel (kernels/triton_fp8.py), to the same bytes, or by the RMSNorm before it (Fp8Rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
FP8_SCALE_DTYPE = torch.float32  # the scales' dtype, per weight row or per cached key / value row
# A row of zeros gets this scale rather than 0, so quantizing it divides by something finite.
FP8_MIN_SCALE = torch.finfo(torch.float32).tiny
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: torch._scaled_mm, and the GEMV's FP8 products
_HALF = (torch.float16, torch.bfloat16)


def quantize_fp8(tensor: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with tensor ≈ q * scale[..., None]: q in float8_e4m3fn, scale float32 of shape tensor.shape[:-1],
    one per row (the row's amax / 448). per_tensor: one amax for each matrix (the last two dimensions), given to
    every row of it, so the result has the same layout either way."""
    values = tensor.float()
    amax = values.abs().amax(dim=(-2, -1) if per_tensor else -1, keepdim=True)
    # A tensor divisor: CUDA divides by a Python number through its reciprocal, an ulp off the rounded quotient
    # that the Triton kernels (and the CPU) compute. Filled on the device, not copied there, so that CUDA graphs
    # capture it.
    scale = (amax / amax.new_full((1,), FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    if per_tensor:
        scale = scale.expand(*values.shape[:-1], 1)
    quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale.squeeze(-1).contiguous()


def quantize_fp8_by(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """tensor in float8_e4m3fn divided by a given scale (a one-element float32 tensor: an FP8 KV cache's static
    per-tensor scale), saturating at ±448 where the scale does not cover the values."""
    return (tensor.float() / scale.reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values that q and its per-row scale stand for."""
    return quantized.float() * scale.unsqueeze(-1)


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized per token for an FP8 matmul, in place of their `dtype` rows: values [T, K]
    float8_e4m3fn and scale [T] float32, the bytes quantize_fp8 gives (kernels/triton_ops.py's RMSNorm writes them
    where the linear after it would quantize its input: one pass over the rows instead of two)."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantized(weight).T + bias in x's dtype, with x quantized to FP8 per token: torch._scaled_mm on GPUs
    that multiply FP8 (scaled_mm_applies), else fp8_linear_reference. weight: [out, in] float8_e4m3fn; weight_scale:
    [out] float32. x may come quantized (Fp8Rows, [T, in])."""
    if isinstance(x, Fp8Rows):
        return _scaled_mm_rows(x.values, x.scale, weight, weight_scale, bias, x.dtype)
    if scaled_mm_applies(x, weight):
        return _scaled_mm_linear(x, weight, weight_scale, bias)
    return fp8_linear_reference(x, weight, weight_scale, bias)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear in float32: the per-token quantized activations and the weight dequantized, then one F.linear."""
    rows = x.reshape(-1, x.shape[-1])
    activations = dequantize_fp8(*quantize_fp8(rows))
    out = F.linear(activations, dequantize_fp8(weight, weight_scale), None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._scaled_mm takes this product: half-precision activations on a CUDA device of compute capability
    8.9+, and the inner and output sizes multiples of 16 (its alignment)."""
    return (x.is_cuda and x.dtype in _HALF and x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0
            and _multiplies_fp8(x.device))


@functools.cache
def _multiplies_fp8(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def _scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    from raylm.kernels.triton_fp8 import quantize_rows_fp8

    quantized, scale = quantize_rows_fp8(rows if rows.stride(-1) == 1 else rows.contiguous())
    out = _scaled_mm_rows(quantized, scale, weight, weight_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _scaled_mm_rows(quantized: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[T, out] in dtype from FP8 rows [T, in] and their scales [T]."""
    # Row-wise scaling: one scale per activation row ([M, 1]) and per weight column of the transposed view ([1, N]);
    # cuBLAS writes bfloat16 under it.
    out = torch._scaled_mm(quantized, weight.t(), scale_a=scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
                           out_dtype=torch.bfloat16)
    out = out.to(dtype)
    if bias is not None:
        out = out + bias
    return out
