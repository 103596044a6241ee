"""The KV-cache write kernels (kernels/triton_kv_cache.py): plain and with the rotation fused, against
storing by index and triton_ops.rotary_embedding."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels.triton_kv_cache import (  # noqa: E402
    rotary_write_kv_cache,
    scales_by_slots,
    value_cache_by_slots,
    write_kv_cache,
)

pytestmark = MODULE_MARKS

ALL_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16"),
              pytest.param(torch.float16, marks=GPU_ONLY, id="fp16")]


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def test_write_kv_cache_stores_at_slots_and_skips_negative_slots(device):
    torch.manual_seed(0)
    k_cache = torch.zeros(4, 16, 2, 64, device=device)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, 2, 64, device=device), torch.randn(3, 2, 64, device=device)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([17, -1, 63], dtype=torch.int32, device=device))
    torch.testing.assert_close(k_cache[1, 1], k[0], atol=0, rtol=0)
    torch.testing.assert_close(v_cache[3, 15], v[2], atol=0, rtol=0)
    assert k_cache.count_nonzero() == k[0].count_nonzero() + k[2].count_nonzero()
    assert v_cache.count_nonzero() == v[0].count_nonzero() + v[2].count_nonzero()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 80)], ids=str)
def test_rotary_write_kv_cache_equals_rotary_then_write(device, dtype, q_heads, kv_heads, head_dim):
    """The fused kernel gives the same queries and cache, bit for bit, as triton_ops.rotary_embedding followed by
    write_kv_cache; k and v are strided views of one qkv tensor, as the model passes them."""
    from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq
    from raylm.kernels.triton_ops import rotary_embedding

    torch.manual_seed(3)
    tokens = 5
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([0, 7, 19, 3, 40], device=device)
    cos, sin = RotaryEmbedding(head_dim, 64, rope_inv_freq(head_dim, 10000.0)).to(device).cos_sin(positions, dtype)
    slots = torch.tensor([17, -1, 63, 34, 40], dtype=torch.int64, device=device)
    caches = [torch.zeros(4, 16, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(4)]

    expected_q, rotated_k = rotary_embedding(q, k, cos, sin)
    write_kv_cache(rotated_k, v, caches[0], caches[1], slots)
    got_q = rotary_write_kv_cache(q, k, v, cos, sin, caches[2], caches[3], slots)

    assert torch.equal(got_q, expected_q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[2][1, 1].count_nonzero() > 0 and caches[2][0].count_nonzero() == 0  # slot 17 written, -1 not


# The quantizing writes of an FP8 cache. Triton's interpreter rounds float32 to float8e4nv wrongly where rounding
# up crosses a power of two (127.9 becomes 64, not 128), so their bytes are compared on the GPU only; the
# attention kernels' reading of an FP8 cache is tested under the interpreter too (test_triton_attention.py).
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=GPU_ONLY, id="fp32"), *ALL_DTYPES[1:]])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["row-scales", "tensor-scales"])
def test_fp8_writes_quantize_each_row_as_the_reference_does(device, dtype, rotary, per_tensor):
    """The same bytes and scales as kernels/attention.py's write (the row's amax / 448, rounded to nearest even;
    or divided by the per-tensor scale, saturating), the untouched slots and the negative slot's left alone."""
    from raylm.kernels.attention import write_kv_cache as reference_write
    from raylm.kernels.fp8 import quantize_fp8
    from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq
    from raylm.kernels.triton_ops import rotary_embedding

    torch.manual_seed(4)
    tokens, kv_heads, head_dim = 6, 2, 64
    q = torch.randn(tokens, 4, head_dim, device=device).to(dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, device=device) * 10.0 ** torch.arange(-2, 4, device=device)[:, None,
                                                                                                            None]).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
    v[2] = 0.0
    slots = torch.tensor([17, -1, 63, 34, 40, 5], device=device)
    cache, scale = quantize_fp8(torch.randn(4, 16, kv_heads, head_dim, device=device))
    if per_tensor:  # the keys' scale covers magnitudes up to 44.8: the larger ones saturate
        mine = [cache.clone(), cache.clone(), torch.tensor([0.1], device=device), torch.tensor([0.01], device=device)]
    else:
        mine = [cache.clone(), cache.clone(), scale.clone(), scale.clone()]
    theirs = [tensor.clone() for tensor in mine]
    if rotary:
        positions = torch.tensor([0, 7, 19, 3, 40, 2], device=device)
        cos, sin = RotaryEmbedding(head_dim, 64, rope_inv_freq(head_dim, 10000.0)).to(device).cos_sin(positions, dtype)
        rotary_write_kv_cache(q, k, v, cos, sin, mine[0], mine[1], slots, kv_scales=(mine[2], mine[3]))
        _, k = rotary_embedding(q, k, cos, sin)
    else:
        write_kv_cache(k, v, mine[0], mine[1], slots, kv_scales=(mine[2], mine[3]))
    written = slots >= 0
    reference_write(k[written], v[written], theirs[0], theirs[1], slots[written], (theirs[2], theirs[3]))
    assert torch.equal(mine[0].view(torch.uint8), theirs[0].view(torch.uint8))
    assert torch.equal(mine[1].view(torch.uint8), theirs[1].view(torch.uint8))
    torch.testing.assert_close(mine[2], theirs[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(mine[3], theirs[3], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "same-dtype"])
def test_writes_into_a_value_cache_transposed_within_its_pages_store_what_writes_by_rows_store(device, dtype,
                                                                                               rotary, fp8):
    """A value cache stored [blocks, heads, dims, slots] takes the same values (an FP8 one the same bytes and
    scales, its scales stored [blocks, heads, slots]) as one stored by rows; keys stay by rows."""
    from raylm.kernels.fp8 import quantize_fp8
    from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq

    torch.manual_seed(6)
    tokens, kv_heads, head_dim, page = 5, 2, 64, 16
    q = torch.randn(tokens, 4, head_dim, device=device).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype) for _ in range(2))
    slots = torch.tensor([17, -1, 63, 34, 5], device=device)
    if fp8:
        cache, scale = quantize_fp8(torch.randn(4, page, kv_heads, head_dim, device=device))
        by_rows = [cache.clone(), cache.clone(), scale.clone(), scale.clone()]
    else:
        by_rows = [torch.randn(4, page, kv_heads, head_dim, device=device).to(dtype) for _ in range(2)]
    transposed = [tensor.clone() for tensor in by_rows]
    stored = value_cache_by_slots(by_rows[1].shape, by_rows[1].dtype, device)
    stored.view(torch.uint8 if fp8 else dtype).copy_(by_rows[1].view(torch.uint8 if fp8 else dtype))
    transposed[1] = stored
    if fp8:  # the scales transposed within their pages too
        transposed[2:] = [scales_by_slots(scale.shape, device) for scale in by_rows[2:]]
        for mine, theirs in zip(transposed[2:], by_rows[2:]):
            mine.copy_(theirs)
    scales = [{"kv_scales": (caches[2], caches[3])} if fp8 else {} for caches in (by_rows, transposed)]
    for caches, fp8_scales in zip((by_rows, transposed), scales):
        if rotary:
            cos, sin = RotaryEmbedding(head_dim, 64, rope_inv_freq(head_dim, 10000.0)).to(device).cos_sin(
                torch.tensor([0, 7, 19, 3, 40], device=device), dtype)
            rotary_write_kv_cache(q, k, v, cos, sin, caches[0], caches[1], slots, **fp8_scales)
        else:
            write_kv_cache(k, v, caches[0], caches[1], slots, **fp8_scales)
    assert transposed[1].stride(1) == 1
    for mine, theirs in zip(transposed, by_rows):
        if mine.element_size() == 1:
            mine, theirs = mine.contiguous().view(torch.uint8), theirs.view(torch.uint8)
        assert torch.equal(mine.contiguous(), theirs)
