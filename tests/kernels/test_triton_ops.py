"""The fused Triton ops against their torch references (kernels/norm.py, rotary.py, activation.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels.activation import gated_activation  # noqa: E402
from raylm.kernels.fp8 import quantize_fp8  # noqa: E402
from raylm.kernels.norm import RMSNorm  # noqa: E402
from raylm.kernels.norm import rms_norm as reference_rms_norm  # noqa: E402
from raylm.kernels.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq  # noqa: E402
from raylm.kernels.triton_ops import (  # noqa: E402
    fused_add_rms_norm,
    rms_norm,
    rms_norm_fp8,
    rotary_embedding,
    silu_and_mul,
    silu_and_mul_fp8,
)

pytestmark = MODULE_MARKS

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16"),
          pytest.param(torch.float16, marks=GPU_ONLY, id="fp16")]
# Half precision: the kernels round once where the reference may round twice, or take a last-bit different
# rsqrt or exp, so a result may sit one unit in the last place away.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (3, 4, 32)], ids=str)
def test_rms_norm_matches_reference(device, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    _assert_close(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rms_norm_with_float32_weight_promotes_like_reference(device):
    torch.manual_seed(1)
    x = torch.randn(5, 4096, dtype=torch.bfloat16, device=device)
    weight = torch.randn(4096, device=device)
    expected = reference_rms_norm(x, weight, 1e-5)
    assert expected.dtype == torch.float32
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), expected, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (9, 1000), (2, 3, 128)], ids=str)
def test_fused_add_rms_norm_matches_reference_and_keeps_inputs(device, dtype, shape):
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    x_before, residual_before = x.clone(), residual.clone()
    norm = RMSNorm(shape[-1], 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
        expected, expected_residual = norm(x, residual)
        normed, new_residual = fused_add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)
    _assert_close(normed, expected)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (9, 1000), (2, 3, 128)], ids=str)
def test_the_norm_adds_a_lora_layers_pending_products_as_adding_them_first_would(device, dtype, shape):
    """A LoRA layer's output with its float32 products still to add (models/lora.py's PendingProducts): the
    RMSNorm after it adds them in its own kernel, bit for bit as x.add_(products) and then the norm; without a
    residual, or on the torch path, the products are added first."""
    from raylm.kernels.policy import KernelPolicy
    from raylm.models.lora import PendingProducts

    torch.manual_seed(5)
    x = torch.randn(shape, dtype=dtype, device=device)
    products = torch.randn(shape, dtype=torch.float32, device=device)
    residual = torch.randn(shape, dtype=dtype, device=device)
    norm = RMSNorm(shape[-1], 1e-5).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
        expected, expected_residual = fused_add_rms_norm(x.clone().add_(products), residual, norm.weight, 1e-5)
        launched = []
        with pytest.MonkeyPatch.context() as patch:
            import raylm.kernels.triton_ops as triton_ops

            fused = triton_ops.fused_add_rms_norm
            patch.setattr(triton_ops, "fused_add_rms_norm", lambda *args, **kwargs: launched.append(
                kwargs.get("extra") is not None) or fused(*args, **kwargs))
            norm.kernels = KernelPolicy(triton=True)
            pending = PendingProducts(x.clone(), products)
            patch.setattr(type(norm.kernels), "on_triton", lambda self, t: True)  # the interpreter's CPU tensors
            normed, new_residual = norm(pending, residual)
        assert launched == [True] and torch.equal(pending.out, x)  # added in the kernel, x left as it was
        assert torch.equal(normed, expected) and torch.equal(new_residual, expected_residual)
        norm.kernels = KernelPolicy()  # the torch path
        alone = norm(PendingProducts(x.clone(), products))
        torched, torched_residual = norm(PendingProducts(x.clone(), products), residual)
    assert torch.equal(alone, reference_rms_norm(x.clone().add_(products), norm.weight, 1e-5))
    assert torch.equal(torched_residual, x.clone().add_(products) + residual)
    _assert_close(torched, expected)
    with pytest.raises(ValueError, match="extra must be float32"):
        fused_add_rms_norm(x, residual, norm.weight, 1e-5, extra=products.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", [(1, 64), (9, 1000), (2, 3, 128)], ids=str)
def test_fp8_rows_of_the_norm_are_the_quantized_norm(device, dtype, with_residual, shape):
    """rms_norm_fp8: the rows the norm gives (rounded to their dtype) quantized per token as quantize_fp8 quantizes
    them, with the same new residual. The bytes are compared on the GPU (Triton's interpreter rounds float32 to FP8
    wrongly where rounding up crosses a power of two); interpreted, the scales and most bytes."""
    torch.manual_seed(4)
    x = torch.randn(shape, dtype=dtype, device=device) * 3
    residual = torch.randn(shape, dtype=dtype, device=device) if with_residual else None
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    if with_residual:
        expected, expected_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    else:
        expected, expected_residual = rms_norm(x, weight, 1e-5), None
    values, scale = quantize_fp8(expected.reshape(-1, shape[-1]))
    rows, new_residual = rms_norm_fp8(x, residual, weight, 1e-5)
    assert rows.dtype == dtype and rows.values.shape == values.shape and rows.scale.shape == scale.shape
    assert (new_residual is None) == (not with_residual)
    if with_residual:
        assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(rows.scale, scale, rtol=1e-6, atol=0)
    if device.type == "cuda":
        assert torch.equal(rows.values.view(torch.uint8), values.view(torch.uint8))
    else:  # all but the values the interpreter misrounds (a few in a hundred) equal
        same = rows.values.view(torch.uint8) == values.view(torch.uint8)
        assert same.float().mean() > 0.9, same.float().mean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (8, 8)], ids=lambda heads: f"q{heads[0]}-k{heads[1]}")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rotary_embedding_matches_reference(device, dtype, heads, head_dim):
    torch.manual_seed(3)
    num_tokens, (num_q_heads, num_k_heads) = 11, heads
    rotary = RotaryEmbedding(head_dim, 4096, rope_inv_freq(head_dim, 10000.0)).to(device)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    cos, sin = rotary.cos_sin(positions, dtype)  # [T, 1, D]
    q = torch.randn(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_k_heads, head_dim, dtype=dtype, device=device)
    expected_q, expected_k = apply_rotary(q, k, (cos, sin))
    for cos_rows, sin_rows in [(cos, sin), (cos.squeeze(1), sin.squeeze(1))]:
        actual_q, actual_k = rotary_embedding(q, k, cos_rows, sin_rows)
        _assert_close(actual_q, expected_q)
        _assert_close(actual_k, expected_k)


def test_rotary_embedding_reads_strided_query_and_key_views(device):
    # q and k as the attention layer has them: column slices of one fused qkv projection.
    torch.manual_seed(4)
    num_tokens, head_dim = 6, 64
    qkv = torch.randn(num_tokens, (4 + 2 + 2) * head_dim, device=device)
    q = qkv[:, : 4 * head_dim].view(num_tokens, 4, head_dim)
    k = qkv[:, 4 * head_dim: 6 * head_dim].view(num_tokens, 2, head_dim)
    rotary = RotaryEmbedding(head_dim, 128, rope_inv_freq(head_dim, 10000.0)).to(device)
    cos, sin = rotary.cos_sin(torch.arange(num_tokens, device=device), torch.float32)
    expected_q, expected_k = apply_rotary(q, k, (cos, sin))
    actual_q, actual_k = rotary_embedding(q, k, cos, sin)
    _assert_close(actual_q, expected_q)
    _assert_close(actual_k, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 200), (3, 3000), (2, 3, 128)], ids=str)
def test_silu_and_mul_matches_reference(device, dtype, shape):
    torch.manual_seed(5)
    gate_up = torch.randn(shape, dtype=dtype, device=device) * 4
    _assert_close(silu_and_mul(gate_up), gated_activation("silu")(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 200), (2, 3, 3000)], ids=str)
def test_silu_and_mul_adds_lora_products_first_as_an_add_would(device, dtype, shape):
    """silu_and_mul(gate_up, extra=e): gate_up gains e (float32 LoRA products left to add) in the same pass, bit for
    bit as gate_up.add_(e) followed by silu_and_mul."""
    torch.manual_seed(8)
    gate_up = torch.randn(shape, dtype=dtype, device=device) * 4
    extra = torch.randn(shape, dtype=torch.float32, device=device)
    assert torch.equal(silu_and_mul(gate_up, extra=extra), silu_and_mul(gate_up.clone().add_(extra)))
    with pytest.raises(ValueError, match="extra must be float32"):
        silu_and_mul(gate_up, extra=extra.to(dtype) if dtype != torch.float32 else extra[..., 1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 2000), (2, 3, 14336 * 2)], ids=str)
@pytest.mark.parametrize("chunk", [16384, 2048, 256], ids=lambda chunk: f"chunk{chunk}")
def test_fp8_rows_of_silu_and_mul_are_its_quantized_rows(device, dtype, shape, chunk):
    """silu_and_mul_fp8: silu_and_mul's rows quantized per token as quantize_fp8 quantizes them (bytes compared on
    the GPU; interpreted, the scales and most bytes: see test_fp8_rows_of_the_norm_are_the_quantized_norm), a row
    held whole or read twice in chunks (its amax, then its bytes)."""
    torch.manual_seed(7)
    gate_up = torch.randn(shape, dtype=dtype, device=device) * 4
    values, scale = quantize_fp8(silu_and_mul(gate_up).reshape(-1, shape[-1] // 2))
    rows = silu_and_mul_fp8(gate_up, chunk=chunk)
    assert rows.dtype == dtype and rows.values.shape == values.shape
    torch.testing.assert_close(rows.scale, scale, rtol=1e-6, atol=0)
    same = rows.values.view(torch.uint8) == values.view(torch.uint8)
    assert same.all() if device.type == "cuda" else same.float().mean() > 0.9


def test_silu_and_mul_fp8_chunks_give_the_same_bytes_whole_or_in_pieces(device):
    """The two-pass kernel (chunks) and the one-pass kernel (the row held whole) compute the same values: bit for
    bit, also interpreted."""
    torch.manual_seed(9)
    gate_up = torch.randn(3, 2 * 3000, device=device) * 4
    whole, pieces = silu_and_mul_fp8(gate_up, chunk=4096), silu_and_mul_fp8(gate_up, chunk=512)
    assert torch.equal(whole.scale, pieces.scale)
    assert torch.equal(whole.values.view(torch.uint8), pieces.values.view(torch.uint8))
    with pytest.raises(ValueError, match="chunk must be a power of 2 of at least 16, got 1000"):
        silu_and_mul_fp8(gate_up, chunk=1000)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_silu_and_mul_fp8_from_fewer_programs_than_rows_gives_the_same_bytes(device, programs):
    """Whole rows from a fixed number of programs, each requesting its next row before computing the current one:
    every row written once, the same bytes and scales as one program a row (bit for bit, also interpreted),
    bf16 rows of an odd width included."""
    torch.manual_seed(10)
    gate_up = torch.randn(7, 2 * 1500, device=device, dtype=torch.bfloat16) * 4
    reference = silu_and_mul_fp8(gate_up)
    rows = silu_and_mul_fp8(gate_up, programs=programs)
    assert torch.equal(rows.scale, reference.scale)
    assert torch.equal(rows.values.view(torch.uint8), reference.values.view(torch.uint8))
    with pytest.raises(ValueError, match="programs must be at least 1"):
        silu_and_mul_fp8(gate_up, programs=0)
    with pytest.raises(ValueError, match="exceed chunk=1024"):
        silu_and_mul_fp8(gate_up, chunk=1024, programs=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_match_reference_at_model_sizes(device, dtype):
    torch.manual_seed(6)
    x = torch.randn(4096, 4096, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, dtype=dtype, device=device)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    _assert_close(new_residual, x + residual)
    _assert_close(normed, reference_rms_norm(x + residual, weight, 1e-5))
    gate_up = torch.randn(4096, 2 * 14336, dtype=dtype, device=device)
    _assert_close(silu_and_mul(gate_up), gated_activation("silu")(gate_up))
