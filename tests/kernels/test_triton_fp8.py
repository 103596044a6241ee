"""The activations' FP8 quantization kernel (kernels/triton_fp8.py) against kernels/fp8.py's quantize_fp8."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

import triton  # noqa: E402  (after kernel_device(), which may ask for Triton's interpreter)
import triton.language as tl  # noqa: E402

from raylm.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8  # noqa: E402
from raylm.kernels.triton_fp8 import divide_by_scale, quantize_rows_fp8, tile_scale  # noqa: E402

pytestmark = MODULE_MARKS


def _rows(dtype: torch.dtype, k: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(k)
    rows = torch.randn(7, k, generator=generator) * 10.0 ** torch.arange(-3, 4)[:, None]
    rows[2] = 0.0  # a zero row: the smallest scale, zeros
    rows[4, 3] = 5000.0  # an outlier sets its row's scale
    return rows.to(DEVICE, dtype)


# Triton's interpreter rounds float32 to float8e4nv wrongly where rounding up crosses a power of two (127.9 becomes
# 64), so the bytes are compared on the GPU; the interpreter checks the scales and the shapes.
@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k", [64, 1000, 4096, 14336])
def test_quantized_rows_are_quantize_fp8_s_bytes(dtype, k):
    rows = _rows(dtype, k)
    quantized, scale = quantize_rows_fp8(rows)
    expected, expected_scale = quantize_fp8(rows)
    assert torch.equal(quantized.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


@pytest.mark.parametrize("k", [64, 1000, 3000])
def test_scales_are_each_row_s_amax_over_448_and_zero_rows_stay_zero(k):
    rows = _rows(torch.float32, k)
    quantized, scale = quantize_rows_fp8(rows)
    assert quantized.shape == rows.shape and scale.shape == (7,)
    assert torch.equal(scale, quantize_fp8(rows)[1])
    assert not dequantize_fp8(quantized[2:3], scale[2:3]).any()


def test_refuses_rows_that_are_not_a_contiguous_matrix():
    with pytest.raises(ValueError, match=r"\[M, K\] rows"):
        quantize_rows_fp8(torch.randn(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match=r"\[M, K\] rows"):
        quantize_rows_fp8(torch.randn(2, 4, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16")])
def test_an_empty_input_gives_empty_rows(dtype):
    quantized, scale = quantize_rows_fp8(torch.empty(0, 64, device=DEVICE, dtype=dtype))
    assert quantized.shape == (0, 64) and scale.shape == (0,)


@triton.jit
def _divide_kernel(values_ptr, scales_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(values_ptr + offsets, mask=mask, other=0.0)
    scales = tl.load(scales_ptr + offsets, mask=mask, other=1.0)
    tl.store(out_ptr + offsets, divide_by_scale(values, scales), mask=mask)


def test_dividing_by_a_scale_rounds_as_torch_divides():
    """divide_by_scale (every FP8 quantizer's division: a reciprocal and an FMA correction) gives torch's correctly
    rounded quotients: bf16 values over 40 binades and by their groups' amax / 448, and float32 values at FP8's
    rounding midpoints times the scale and one ulp either side, where a quotient an ulp off would round to another
    FP8 value; bit for bit, so -0.0 stays -0.0 (FP8's 0x80)."""
    generator = torch.Generator().manual_seed(3)
    n = 1 << 16
    values = (torch.randn(n, generator=generator) * torch.exp(torch.empty(n).uniform_(-14, 14, generator=generator)))
    values = values.bfloat16().float()
    scales = torch.clamp(values.abs().reshape(-1, 64).amax(dim=1) / 448.0, min=torch.finfo(torch.float32).tiny)
    scales = scales.repeat_interleave(64)
    midpoints = torch.randint(-447 * 8, 447 * 8, (n,), generator=generator) / 8.0 + 1 / 16
    at_midpoints = midpoints * scales
    sides = torch.where(torch.rand(n, generator=generator) < 0.5, -torch.inf, torch.inf)
    values[:8] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 0.0, -0.0, 3.0, -3.0])
    values = torch.cat([values, at_midpoints, torch.nextafter(at_midpoints, sides)]).to(DEVICE)
    scales = scales.repeat(3).to(DEVICE)
    out = torch.empty_like(values)
    _divide_kernel[(triton.cdiv(values.numel(), 1024),)](values, scales, out, values.numel(), BLOCK=1024)
    assert torch.equal(out.view(torch.int32), (values / scales).view(torch.int32))


@triton.jit
def _tile_scale_kernel(amax_ptr, scale_ptr, inverse_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    scale, inverse = tile_scale(tl.load(amax_ptr + offsets, mask=mask, other=1.0))
    tl.store(scale_ptr + offsets, scale, mask=mask)
    tl.store(inverse_ptr + offsets, inverse, mask=mask)


def test_tile_scales_put_the_amax_on_448():
    """tile_scale (the "fp8_tiles" GEMV input's scales): the inverse 448 / amax rounded as torch divides, the scale
    amax times 1 / 448 in float32, bit for bit over the float32 range, at zero and subnormals (held at 2^-60); the
    amax times the inverse quantizes to 448."""
    generator = torch.Generator().manual_seed(5)
    amax = torch.cat([torch.exp2(torch.empty(4096).uniform_(-59, 127, generator=generator)),
                      torch.tensor([0.0, 1e-45, 1e-30, 2.0**-60, 3.0e38, 1.0, 448.0, 1.75])])
    held = amax.clamp(min=2.0**-60)
    scale, inverse = torch.empty_like(amax).to(DEVICE), torch.empty_like(amax).to(DEVICE)
    _tile_scale_kernel[(triton.cdiv(amax.numel(), 1024),)](amax.to(DEVICE), scale, inverse, amax.numel(), BLOCK=1024)
    assert torch.equal(inverse.cpu(), torch.full_like(held, 448.0) / held)  # (448.0 / held: a reciprocal times 448)
    assert torch.equal(scale.cpu(), held * torch.tensor(1 / 448.0))
    assert torch.equal((held * inverse.cpu()).to(FP8_DTYPE).float(), torch.full_like(amax, 448.0))
