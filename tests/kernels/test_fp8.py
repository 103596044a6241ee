"""kernels/fp8.py: quantizing to float8_e4m3fn per row or per tensor, and the FP8 linear layer: its float32
reference on the CPU, and torch._scaled_mm on GPUs against that reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    fp8_linear,
    fp8_linear_reference,
    quantize_fp8,
    scaled_mm_applies,
)

# float8_e4m3fn keeps 3 mantissa bits: rounding moves a value by at most 2^-4 of itself, and a value below the
# smallest normal (2^-6 of the scale) by at most half the subnormal step (2^-10 of the scale). Bounded by the row's
# amax, that is at most 2^-4 * amax; the test states the looser 2^-3.
ROUND_TRIP_BOUND = 2**-3


def _rows_with_outliers(generator: torch.Generator) -> torch.Tensor:
    values = torch.randn(64, 96, generator=generator)
    values[3] *= 1000.0  # rows of very different magnitudes
    values[7] *= 1e-4
    values[9, 5] = 300.0  # an outlier inside a row
    return values


@pytest.mark.parametrize("per_tensor", [False, True])
def test_quantize_round_trip_error_is_bounded_by_fp8_precision_of_each_rows_amax(per_tensor):
    values = _rows_with_outliers(torch.Generator().manual_seed(0))
    quantized, scale = quantize_fp8(values, per_tensor=per_tensor)
    assert quantized.dtype == FP8_DTYPE and quantized.shape == values.shape
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    amax = values.abs().amax(dim=-1)
    if per_tensor:  # one scale for the matrix, given to every row
        assert torch.equal(scale, torch.full((64,), values.abs().max().item() / FP8_MAX))
        bound = values.abs().max() * ROUND_TRIP_BOUND
    else:
        torch.testing.assert_close(scale, amax / FP8_MAX, rtol=0, atol=0)
        bound = (amax * ROUND_TRIP_BOUND).unsqueeze(-1)
    error = (dequantize_fp8(quantized, scale) - values).abs()
    assert (error <= bound).all()
    assert quantized.float().abs().max() <= FP8_MAX  # the row's amax lands on 448, never past it (NaN)


def test_per_tensor_scales_each_matrix_of_a_stack_apart_and_zero_rows_stay_zero():
    stack = torch.randn(3, 8, 16)
    stack[1] *= 50.0
    stack[2, 4] = 0.0
    quantized, scale = quantize_fp8(stack, per_tensor=True)
    assert scale.shape == (3, 8)
    for matrix in range(3):
        assert torch.equal(scale[matrix], torch.full((8,), stack[matrix].abs().max().item() / FP8_MAX))
    _, row_scale = quantize_fp8(stack)
    assert (row_scale[2, 4] > 0) and not quantized.float().isnan().any()
    assert torch.equal(dequantize_fp8(*quantize_fp8(stack))[2, 4], torch.zeros(16))


def test_reference_linear_is_quantized_activations_times_dequantized_weight_in_float32():
    generator = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(48, 32, generator=generator), torch.randn(48, generator=generator)
    x = torch.randn(2, 5, 32, generator=generator)
    weight_q, weight_scale = quantize_fp8(weight)
    x_q, x_scale = quantize_fp8(x.reshape(10, 32))
    expected = F.linear(x_q.float() * x_scale[:, None], weight_q.float() * weight_scale[:, None], bias)
    got = fp8_linear(x, weight_q, weight_scale, bias)  # on the CPU: the reference
    assert got.shape == (2, 5, 48)
    assert torch.equal(got.reshape(10, 48), expected)
    relative = (got - F.linear(x, weight, bias)).norm() / F.linear(x, weight, bias).norm()
    assert relative < 0.06  # FP8 of both operands: a few percent of the product
    half = fp8_linear(x.bfloat16(), weight_q, weight_scale, bias.bfloat16())
    assert half.dtype == torch.bfloat16


def test_scaled_mm_is_only_chosen_on_cuda():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert not scaled_mm_applies(x, torch.zeros(16, 32, dtype=FP8_DTYPE))


def _needs_fp8_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9+ (FP8 matmuls)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_scaled_mm_path_equals_the_reference_on_gpu(dtype, rows):
    _needs_fp8_gpu()
    generator = torch.Generator(device="cuda").manual_seed(2)
    weight = torch.randn(512, 256, device="cuda", generator=generator)
    weight_q, weight_scale = quantize_fp8(weight)
    x = torch.randn(rows, 256, device="cuda", generator=generator).to(dtype)
    bias = torch.randn(512, device="cuda", generator=generator).to(dtype)
    assert scaled_mm_applies(x, weight_q)
    got = fp8_linear(x, weight_q, weight_scale, bias)
    expected = fp8_linear_reference(x, weight_q, weight_scale, bias)
    assert got.dtype == dtype and got.shape == expected.shape
    # Same FP8 operands; they differ only in accumulation order and the bfloat16 output of the scaled matmul.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_unaligned_sizes_fall_back_to_the_reference_on_gpu():
    _needs_fp8_gpu()
    weight_q, weight_scale = quantize_fp8(torch.randn(40, 24, device="cuda"))  # not multiples of 16
    x = torch.randn(3, 24, device="cuda", dtype=torch.bfloat16)
    assert not scaled_mm_applies(x, weight_q)
    assert torch.equal(fp8_linear(x, weight_q, weight_scale), fp8_linear_reference(x, weight_q, weight_scale))
