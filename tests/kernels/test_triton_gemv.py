"""The decode GEMV kernel (kernels/triton_gemv.py) against F.linear, and the layers' dispatch to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels.norm import rms_norm  # noqa: E402
from raylm.kernels.triton_gemv import GEMV_MAX_ROWS, gemv, rms_norm_gemv, silu_mul_gemv  # noqa: E402

pytestmark = MODULE_MARKS

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16")]
# Both sum K products in float32 and round once, in different orders: about one unit in the last place.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (100, 300), (48, 1030)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gemv_matches_linear(dtype, rows, n, k, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    expected = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None).to(dtype)
    got = gemv(x, weight, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_gemv_keeps_leading_dimensions_and_refuses_what_it_cannot_do():
    x = torch.randn(2, 1, 64).to(DEVICE, torch.float16)
    weight = torch.randn(32, 64).to(DEVICE, torch.float16)
    assert gemv(x, weight).shape == (2, 1, 32)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 64).to(DEVICE, torch.float16), weight)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        gemv(x.float(), weight.float())
    with pytest.raises(ValueError, match="does not fit"):
        gemv(torch.randn(1, 63).to(DEVICE, torch.float16), weight)


def _silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up rounded as the model's unfused path rounds it (activation, then product, in the dtype)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (100, 300)], ids=str)
def test_silu_mul_gemv_matches_activation_then_linear(dtype, rows, n, k):
    generator = torch.Generator().manual_seed(rows * 7 + n + k)
    gate_up = torch.randn(rows, 2 * k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype)
    expected = F.linear(_silu_mul_reference(gate_up).float(), weight.float(), bias.float()).to(dtype)
    got = silu_mul_gemv(gate_up, weight, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (48, 1030)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["", "residual"])
def test_rms_norm_gemv_matches_norm_then_linear(dtype, rows, n, k, with_residual):
    generator = torch.Generator().manual_seed(rows * 11 + n + k + with_residual)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    residual = torch.randn(rows, k, generator=generator).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=generator)).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    summed = (x.float() + residual.float()).to(dtype) if with_residual else x
    normed = rms_norm(summed, norm_weight, 1e-6)
    expected = F.linear(normed.float(), weight.float()).to(dtype)
    got, residual_out = rms_norm_gemv(x, residual, norm_weight, 1e-6, weight)
    assert got.shape == (rows, n) and got.dtype == dtype
    # The norm's sum of squares is taken in another order than the reference's: one more rounding's worth.
    torch.testing.assert_close(got, expected, atol=2 * TOLERANCE[dtype], rtol=2 * TOLERANCE[dtype])
    if with_residual:
        assert torch.equal(residual_out, summed)
    else:
        assert residual_out is None


def test_fused_gemvs_refuse_what_they_cannot_do():
    weight = torch.randn(32, 64).to(DEVICE, torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        silu_mul_gemv(torch.randn(1, 64).to(DEVICE, torch.float16), weight)  # needs gate and up: 128 columns
    with pytest.raises(ValueError, match="norm_weight must be"):
        rms_norm_gemv(torch.randn(1, 64).to(DEVICE, torch.float16), None, torch.ones(63).to(DEVICE, torch.float16),
                      1e-6, weight)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_gemv(torch.randn(1, 64).to(DEVICE, torch.float16), torch.randn(2, 64).to(DEVICE, torch.float16),
                      torch.ones(64).to(DEVICE, torch.float16), 1e-6, weight)
