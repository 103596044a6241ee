"""The Triton paged-attention kernels against the torch reference backend (kernels/attention.py).

Each case builds a step the way the engine does: random caches with a random block assignment, the step's
new keys and values written at their slots, then decode and prefill attention over the cache. The reference
runs the same step in float32 (build_metadata + paged_attention); the kernels must agree with it and must
leave the caches exactly as the reference's write does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels.attention import build_metadata, paged_attention  # noqa: E402
from raylm.kernels.attention import write_kv_cache as reference_write_kv_cache  # noqa: E402
from raylm.kernels.attention_tiles import TileConfig  # noqa: E402
from raylm.kernels.fp8 import dequantize_fp8, quantize_fp8, quantize_fp8_by  # noqa: E402
from raylm.kernels.triton_attention import (  # noqa: E402
    choose_num_splits,
    decode_config,
    paged_decode_attention,
    rotary_decode_attention,
)
from raylm.kernels.triton_kv_cache import (  # noqa: E402
    rotary_write_kv_cache,
    scales_by_slots,
    value_cache_by_slots,
    write_kv_cache,
)
from raylm.kernels.triton_prefill_attention import paged_prefill_attention  # noqa: E402

pytestmark = MODULE_MARKS

HALF_DTYPES = [pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16"),
               pytest.param(torch.float16, marks=GPU_ONLY, id="fp16")]
ALL_DTYPES = [pytest.param(torch.float32, id="fp32"), *HALF_DTYPES]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# The relative rounding of an output in each dtype (half an ulp, doubled for slack).
OUTPUT_ROUNDING = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7}


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test's random caches and queries are its own, whatever ran before it (a failure on the GPU reproduces
    when its test runs alone)."""
    torch.manual_seed(0)


@dataclass
class Shape:
    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int

    def __str__(self) -> str:
        return f"page{self.page_size}-kv{self.num_kv_heads}x{self.group}-d{self.head_dim}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _run_step(device: torch.device, dtype: torch.dtype, shape: Shape, decode_lens: list[int],
              prefill_chunks: list[tuple[int, int]], sliding_window: int | None = None,
              num_splits: int | None = None, planner=None, fp8: bool = False, transposed_values: bool = False,
              fp8_dot: bool = False, prefill_tiles: TileConfig | None = None,
              decode_tiles: TileConfig | None = None, tensor_scales: bool = False) -> None:
    """Runs one step of decodes (context lengths) then prefill chunks ((start, query_len)) through the
    kernels and through the reference, and asserts that outputs and caches agree. With a planner (the
    FlashInfer backend's build_metadata), the step runs through the metadata it plans instead of the Triton
    attention kernels. With fp8, the caches are FP8 with their scales, and the reference reads them as its own.
    With transposed_values, the kernels' value cache is stored transposed within its pages, the reference's by
    rows. With fp8_dot (decodes only), the decode multiplies in FP8: the reference takes each query row quantized
    to FP8 as the kernel quantizes it, and the outputs may differ by the probabilities' FP8 rounding. prefill_tiles:
    the prefill kernel's tiles instead of its default; decode_tiles, the decode kernel's. tensor_scales: the FP8
    cache has one scale for its keys and one for its values (each its tensor's amax / 300: no saturation)."""
    page_size, num_kv_heads, head_dim = shape.page_size, shape.num_kv_heads, shape.head_dim
    num_q_heads = num_kv_heads * shape.group
    context_lens = decode_lens + [start + length for start, length in prefill_chunks]
    # Block 0 is the reference's null block; one spare block is never assigned.
    counts = [_cdiv(length, page_size) for length in context_lens]
    num_blocks = sum(counts) + 2
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_lists = []
    for count in counts:
        block_lists.append(ids[:count])
        ids = ids[count:]
    width = max(counts) + 1  # wider than any sequence needs, as a padded engine table is
    table = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in block_lists], dtype=torch.int32,
                         device=device)

    def slot(seq: int, position: int) -> int:
        return block_lists[seq][position // page_size] * page_size + position % page_size

    num_decodes = len(decode_lens)
    slots = [slot(seq, length - 1) for seq, length in enumerate(decode_lens)]
    for index, (start, length) in enumerate(prefill_chunks):
        slots += [slot(num_decodes + index, position) for position in range(start, start + length)]
    num_tokens = len(slots)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size).to(dtype).to(device)

    k_cache, v_cache = randn(num_blocks, page_size, num_kv_heads, head_dim), randn(num_blocks, page_size,
                                                                                  num_kv_heads, head_dim)
    q, k, v = randn(num_tokens, num_q_heads, head_dim), randn(num_tokens, num_kv_heads, head_dim), randn(
        num_tokens, num_kv_heads, head_dim)
    scale = head_dim**-0.5

    decode_contexts = [(block_lists[seq], length) for seq, length in enumerate(decode_lens)]
    chunks = [(block_lists[num_decodes + index], start, length) for index, (start, length) in enumerate(prefill_chunks)]
    meta = build_metadata(decode_contexts, chunks, slots, page_size, sliding_window, device)
    scales = {}
    if fp8:  # rows of very different magnitudes, each with its own scale (FP8 queries: a tenth of them)
        exponents = torch.randint(-1, 2, k_cache.shape[:3], device=device) if fp8_dot else torch.randint(
            -2, 3, k_cache.shape[:3], device=device)
        magnitudes = 10.0 ** exponents[..., None]
        k_cache = k_cache.float() * magnitudes
        if tensor_scales:
            k_scale, v_scale = ((cache.float().abs().amax() / 300).reshape(1) for cache in (k_cache, v_cache))
            k_cache, v_cache = quantize_fp8_by(k_cache, k_scale), quantize_fp8_by(v_cache, v_scale)
        else:
            (k_cache, k_scale), (v_cache, v_scale) = quantize_fp8(k_cache), quantize_fp8(v_cache)
        scales = {"kv_scales": (k_scale, v_scale)}
        ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
        ref_scales = (k_scale.clone(), v_scale.clone())
        ref_q = dequantize_fp8(*quantize_fp8(q)) if fp8_dot else q.float()
        expected = paged_attention(ref_q, k.float(), v.float(), ref_k_cache, ref_v_cache, meta, scale, ref_scales)
        caches, ref_caches = (k_cache, v_cache, k_scale, v_scale), (ref_k_cache, ref_v_cache, *ref_scales)
    else:
        ref_k_cache, ref_v_cache = k_cache.float(), v_cache.float()
        expected = paged_attention(q.float(), k.float(), v.float(), ref_k_cache, ref_v_cache, meta, scale)
        caches, ref_caches = (k_cache, v_cache), (ref_k_cache, ref_v_cache)

    if planner is not None:
        out = planner(decode_contexts, chunks, slots, page_size, sliding_window, device).attend(
            q, k, v, k_cache, v_cache, scale)
        _assert_step_matches(out, expected, (k_cache, v_cache), (ref_k_cache, ref_v_cache), dtype)
        return
    slot_tensor = torch.tensor(slots, dtype=torch.int64, device=device)
    if fp8:  # the quantizing write has tests of its own (test_triton_kv_cache.py): these test reading the cache
        reference_write_kv_cache(k, v, k_cache, v_cache, slot_tensor, scales["kv_scales"])
        if transposed_values:  # the scales too (scales_by_slots) where they are per row
            v_cache = transposed_within_pages(v_cache)
            if not tensor_scales:
                scales = {"kv_scales": tuple(scales_transposed_within_pages(scale) for scale in scales["kv_scales"])}
            caches = (*caches[:2], *scales["kv_scales"])
    else:
        if transposed_values:
            v_cache = transposed_within_pages(v_cache)
        write_kv_cache(k, v, k_cache, v_cache, slot_tensor)
    caches = (k_cache, v_cache, *caches[2:])
    out = torch.empty_like(q)
    if num_decodes:
        out[:num_decodes] = paged_decode_attention(
            q[:num_decodes], k_cache, v_cache, table[:num_decodes],
            torch.tensor(decode_lens, dtype=torch.int32, device=device), scale, sliding_window, num_splits, **scales,
            **({"fp8_dot": True} if fp8_dot else {}), config=decode_tiles)
    if prefill_chunks:
        query_lens = torch.tensor([length for _, length in prefill_chunks], dtype=torch.int32)
        query_start_loc = torch.zeros(len(prefill_chunks) + 1, dtype=torch.int32)
        query_start_loc[1:] = query_lens.cumsum(0)
        seq_starts = torch.tensor([start for start, _ in prefill_chunks], dtype=torch.int32)
        out[num_decodes:] = paged_prefill_attention(
            q[num_decodes:], k_cache, v_cache, table[num_decodes:], query_start_loc.to(device),
            seq_starts.to(device), (seq_starts + query_lens).to(device), scale, sliding_window, **scales,
            config=prefill_tiles)

    if fp8_dot:
        assert all(torch.equal(cache.float(), ref.float()) for cache, ref in zip(caches, ref_caches))
        gap = (out.float() - expected).abs()
        excess = gap - _fp8_dot_bound(ref_q, k, v, ref_k_cache, ref_v_cache, ref_scales, meta, scale, expected, dtype)
        assert excess.max() <= 0, (excess.max(), gap.max())
        return
    _assert_step_matches(out, expected, caches, ref_caches, dtype)


def _fp8_dot_bound(ref_q, k, v, ref_k_cache, ref_v_cache, ref_scales, meta, scale, expected, dtype) -> torch.Tensor:
    """How far each output of decode attention with FP8 products (fp8_dot) may be from the reference's over the
    same FP8 queries and cache. Each probability is rounded to e4m3 (4 significant bits) as a weight of at most
    256: a normal weight moves by at most 1/16 of itself, so an output (the weighted values over the unrounded
    weights' sum, at least 1) by at most the probability-weighted mean of |value| / 16, which the reference gives
    over the values' magnitudes. A subnormal weight moves by at most 2^-10 of 256 units of the tile's largest value
    scale: max|value| 2^-18 a key. Then the output's own rounding to its dtype."""
    magnitudes = (ref_v_cache.view(torch.uint8) & 0x7F).view(ref_v_cache.dtype)  # |value|: e4m3's sign bit cleared
    weighted = paged_attention(ref_q, k.float(), v.float().abs(), ref_k_cache.clone(), magnitudes, meta, scale,
                               tuple(scales.clone() for scales in ref_scales))
    largest = dequantize_fp8(magnitudes, ref_scales[1]).max()
    keys = meta.decode_mask.shape[-1] if meta.num_decode_tokens else 0
    return weighted / 16 + keys * 2**-18 * largest + OUTPUT_ROUNDING[dtype] * expected.abs() + 1e-6


def transposed_within_pages(cache: torch.Tensor) -> torch.Tensor:
    """cache's contents in a cache stored transposed within its pages: [blocks, heads, dims, slots] in memory, seen
    as [blocks, slots, heads, dims] (contiguous slots)."""
    stored = value_cache_by_slots(cache.shape, cache.dtype, cache.device)
    assert not stored.float().any()  # zeroed: decode reads whole runs of slots, unwritten ones too
    if cache.element_size() == 1:  # float8 copies go through their bytes (no CPU copy kernel for every case)
        stored.view(torch.uint8).copy_(cache.view(torch.uint8))
    else:
        stored.copy_(cache)
    assert stored.stride(1) == 1 and torch.equal(stored.float(), cache.float())
    return stored


def scales_transposed_within_pages(scale: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's scales [blocks, slots, heads] in a tensor stored transposed within its pages."""
    stored = scales_by_slots(scale.shape, scale.device)
    stored.copy_(scale)
    assert stored.stride(1) == 1
    return stored


def _assert_step_matches(out, expected, caches, ref_caches, dtype: torch.dtype) -> None:
    assert all(torch.equal(cache.float(), ref.float()) for cache, ref in zip(caches, ref_caches))
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


# ------------------------------------------------------------------------------------------ decode

DECODE_SHAPES = [Shape(16, 2, 4, 64), Shape(32, 1, 8, 128), Shape(64, 4, 1, 32), Shape(16, 2, 7, 80),
                 Shape(128, 1, 2, 256)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=str)
def test_decode_matches_reference_over_short_contexts(device, dtype, shape):
    torch.manual_seed(1)
    _run_step(device, dtype, shape, decode_lens=[1, 15, 16, 17, 100], prefill_chunks=[])


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
@pytest.mark.parametrize("shape", [Shape(16, 2, 4, 64), Shape(32, 1, 8, 128)], ids=str)
def test_decode_split_k_matches_reference_over_long_contexts(device, shape, num_splits):
    torch.manual_seed(2)
    _run_step(device, torch.float32, shape, decode_lens=[1, 1100, 2049], prefill_chunks=[], num_splits=num_splits)


@pytest.mark.parametrize("sliding_window", [1, 8, 100])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window_hides_old_keys(device, sliding_window, num_splits):
    torch.manual_seed(3)
    _run_step(device, torch.float32, Shape(16, 2, 2, 64), decode_lens=[1, 17, 300], prefill_chunks=[],
              sliding_window=sliding_window, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_with_empty_context_returns_zeros(device, num_splits):
    k_cache = torch.randn(3, 16, 1, 32, device=device)
    table = torch.tensor([[1], [2]], dtype=torch.int32, device=device)
    q = torch.randn(2, 2, 32, device=device)
    context_lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, k_cache, table, context_lens, 1.0, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


def test_choose_num_splits_fills_the_gpu_only_when_contexts_are_long(device):
    # Few sequences over long contexts split; a full batch or short contexts do not.
    assert choose_num_splits(1, 8, 32768, device) > 8
    assert choose_num_splits(256, 8, 32768, device) == 1
    assert choose_num_splits(1, 8, 200, device) == 1
    assert 1 <= choose_num_splits(16, 8, 4096, device) <= 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_matches_reference_over_a_large_batch(device, dtype):
    torch.manual_seed(4)
    lengths = torch.randint(1, 4097, (64,)).tolist()
    _run_step(device, dtype, Shape(16, 8, 4, 128), decode_lens=lengths, prefill_chunks=[])

def _decode_step_tables(device, lengths, page, padded):
    """A decode step over sequences of these lengths: shuffled block tables (block 0 the null block), each
    sequence's newest slot (negative for row `padded`, as graph padding), the lengths, and the blocks in use."""
    counts = [_cdiv(length, page) for length in lengths]
    ids = (torch.randperm(sum(counts)) + 1).tolist()
    tables = []
    for count in counts:
        tables.append(ids[:count] + [0] * (max(counts) - count))
        ids = ids[count:]
    slots = [tables[seq][(length - 1) // page] * page + (length - 1) % page for seq, length in enumerate(lengths)]
    slots[padded] = -1
    return (torch.tensor(tables, dtype=torch.int32, device=device),
            torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor(lengths, dtype=torch.int32, device=device), sum(counts))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [Shape(16, 2, 4, 64), Shape(16, 2, 7, 80), Shape(32, 1, 8, 128)], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rotary_decode_attention_equals_rotary_write_then_decode(device, dtype, shape, num_splits):
    """Rotating and storing the new keys inside the decode kernel gives the cache of rotary_write_kv_cache bit for
    bit, and its attention; q, k and v are strided views of one qkv tensor, as the model passes them; one
    sequence's slot is negative (graph padding: nothing stored, its newest key read from the null block)."""
    from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq

    torch.manual_seed(10)
    page, kv_heads, head_dim = shape.page_size, shape.num_kv_heads, shape.head_dim
    q_heads = kv_heads * shape.group
    lengths = [1, 17, 300, 64]
    table, slot_mapping, context_lens, num_blocks = _decode_step_tables(device, lengths, page, padded=1)
    batch = len(lengths)
    qkv = torch.randn(batch, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k, v = (t.view(batch, -1, head_dim) for t in qkv.split([q_heads * head_dim, kv_heads * head_dim,
                                                               kv_heads * head_dim], dim=-1))
    cos, sin = RotaryEmbedding(head_dim, 512, rope_inv_freq(head_dim, 10000.0)).to(device).cos_sin(
        context_lens.long() - 1, dtype)
    base = torch.randn(num_blocks + 1, page, kv_heads, head_dim).to(device, dtype)
    base[0] = 0  # the null block
    caches = [base.clone() for _ in range(4)]

    rotated = rotary_write_kv_cache(q, k, v, cos, sin, caches[0], caches[1], slot_mapping)
    expected = paged_decode_attention(rotated, caches[0], caches[1], table, context_lens, head_dim**-0.5,
                                      num_splits=num_splits)
    got = rotary_decode_attention(q, k, v, cos, sin, caches[2], caches[3], slot_mapping, table, context_lens,
                                  head_dim**-0.5, num_splits=num_splits)

    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert got.is_contiguous()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rotary_decode_attention_adds_the_addends_as_an_add_before_it_would(device, dtype, num_splits):
    """A LoRA qkv layer's float32 products given as addends: the cache and the output are bit for bit those of
    q, k and v with the products added first (q.add_(products), rounded to their dtype); padded rows too."""
    from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq

    torch.manual_seed(11)
    page, kv_heads, group, head_dim = 16, 2, 4, 64
    q_heads = kv_heads * group
    lengths = [1, 40, 300]
    table, slot_mapping, context_lens, num_blocks = _decode_step_tables(device, lengths, page, padded=0)
    batch, sizes = len(lengths), [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def heads(qkv):
        return tuple(t.view(batch, -1, head_dim) for t in qkv.split(sizes, dim=-1))

    qkv = torch.randn(batch, sum(sizes), device=device).to(dtype)
    products = torch.randn(batch, sum(sizes), device=device) / 8
    cos, sin = RotaryEmbedding(head_dim, 512, rope_inv_freq(head_dim, 10000.0)).to(device).cos_sin(
        context_lens.long() - 1, dtype)
    base = torch.randn(num_blocks + 1, page, kv_heads, head_dim).to(device, dtype)
    base[0] = 0
    caches = [base.clone() for _ in range(4)]

    expected = rotary_decode_attention(*heads(qkv.clone().add_(products)), cos, sin, caches[0], caches[1],
                                       slot_mapping, table, context_lens, head_dim**-0.5, num_splits=num_splits)
    got = rotary_decode_attention(*heads(qkv), cos, sin, caches[2], caches[3], slot_mapping, table, context_lens,
                                  head_dim**-0.5, num_splits=num_splits, addends=heads(products))

    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="addends of q must be float32"):
        rotary_decode_attention(*heads(qkv), cos, sin, caches[2], caches[3], slot_mapping, table, context_lens,
                                head_dim**-0.5, addends=heads(products.to(dtype) if dtype != torch.float32
                                                              else products.double()))


# ------------------------------------------------------------------------------------------ prefill

PREFILL_SHAPES = [Shape(16, 2, 4, 64), Shape(32, 1, 8, 128), Shape(64, 2, 1, 32), Shape(16, 1, 7, 80),
                  Shape(16, 1, 2, 256)]
PREFILL_CHUNKS = [(0, 1), (0, 17), (5, 1), (16, 40), (100, 3), (0, 70)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=str)
def test_prefill_matches_reference_over_cached_prefixes(device, dtype, shape):
    torch.manual_seed(5)
    _run_step(device, dtype, shape, decode_lens=[], prefill_chunks=PREFILL_CHUNKS)


@pytest.mark.parametrize("sliding_window", [1, 16, 50])
def test_prefill_sliding_window_hides_old_keys(device, sliding_window):
    torch.manual_seed(6)
    _run_step(device, torch.float32, Shape(16, 2, 2, 64), decode_lens=[],
              prefill_chunks=[(0, 90), (30, 45), (200, 2)], sliding_window=sliding_window)


def test_prefill_matches_reference_over_a_long_chunk_and_a_long_prefix(device):
    torch.manual_seed(7)
    _run_step(device, torch.float32, Shape(32, 1, 4, 64), decode_lens=[], prefill_chunks=[(0, 1000), (600, 700)])


def test_decodes_and_prefills_of_one_step_match_the_reference_step(device):
    torch.manual_seed(8)
    _run_step(device, torch.float32, Shape(16, 2, 4, 64), decode_lens=[3, 33, 400],
              prefill_chunks=[(0, 20), (48, 17)], sliding_window=64, num_splits=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_matches_reference_over_thousands_of_tokens(device, dtype):
    torch.manual_seed(9)
    _run_step(device, dtype, Shape(16, 8, 4, 128), decode_lens=[],
              prefill_chunks=[(0, 3000), (4000, 1), (1500, 2500), (0, 5)], sliding_window=None)


# ------------------------------------------------------------------------------------------ FP8 cache


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [Shape(16, 2, 4, 64), Shape(16, 2, 7, 80)], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_cache_decode_matches_the_reference_reading_the_same_cache(device, dtype, shape, num_splits):
    """Rows of magnitudes 0.01 to 100, each with its own scale."""
    _run_step(device, dtype, shape, [1, 17, 40, 300], [], num_splits=num_splits, fp8=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [Shape(16, 2, 4, 64), Shape(16, 1, 7, 80)], ids=str)
def test_fp8_cache_prefill_and_decode_of_one_step_match_the_reference(device, dtype, shape):
    _run_step(device, dtype, shape, [5, 33], [(0, 17), (16, 40), (100, 3)], fp8=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "same-dtype"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 37])
@pytest.mark.parametrize("tiles", [TileConfig(16, 64, 4, 3, warp_split=True),
                                   TileConfig(16, 128, 2, 2, warp_split=True)],
                         ids=lambda tiles: f"n{tiles.block_n}-w{tiles.num_warps}")
def test_decode_in_slices_of_keys_a_warp_matches_the_reference(device, dtype, fp8, num_splits, sliding_window, tiles):
    """warp_split tiles (values by slots): each warp's slice of a tile keeps its own softmax state, merged after
    the loop; contexts shorter than a slice, ending inside one, and over many tiles."""
    _run_step(device, dtype, Shape(16, 2, 4, 64), [1, 17, 40, 300], [], sliding_window=sliding_window,
              num_splits=num_splits, fp8=fp8, transposed_values=True, decode_tiles=tiles)


def test_warp_split_tiles_refuse_what_they_cannot_read(device):
    q = torch.randn(1, 2, 64, device=device)
    cache = torch.zeros(3, 16, 2, 64, device=device)
    table, lens = torch.tensor([[1]], dtype=torch.int32, device=device), torch.tensor([5], device=device)
    with pytest.raises(ValueError, match="warp_split tiles need values by slots"):
        paged_decode_attention(q, cache, cache.clone(), table, lens, 0.125,
                               config=TileConfig(16, 64, 4, 3, warp_split=True))
    with pytest.raises(ValueError, match="warp_split tiles need"):
        paged_decode_attention(q, cache, value_cache_by_slots(cache.shape, cache.dtype, device), table, lens, 0.125,
                               config=TileConfig(16, 32, 4, 3, warp_split=True))


@pytest.mark.parametrize("tiles", [TileConfig(128, 32, 8, 2), TileConfig(64, 64, 8, 2), TileConfig(128, 64, 8, 3)],
                         ids=lambda tiles: f"m{tiles.block_m}-n{tiles.block_n}")
def test_fp8_cache_prefill_under_other_tiles_matches_the_reference(device, tiles):
    """The FP8 cache as the engine stores it (values and scales by slots), under the tiles a prefill sweep times
    (benchmarks/prefill_attention.py) against the default."""
    _run_step(device, torch.float32, Shape(16, 2, 4, 64), [], [(0, 17), (16, 40), (100, 3)], fp8=True,
              transposed_values=True, prefill_tiles=tiles)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "same-dtype"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_a_value_cache_transposed_within_its_pages_reads_and_writes_as_one_by_rows(device, dtype, fp8, num_splits,
                                                                                   sliding_window):
    """The kernels take the value cache's own strides: stored [blocks, heads, dims, slots], decode, prefill over a
    cached prefix, and the write of the step's values give what a cache by rows gives (an FP8 one's scales stored
    transposed within their pages too). The decode reads such values in whole runs of a page's keys from a run's
    start, also where a window or a split starts mid-page."""
    _run_step(device, dtype, Shape(16, 2, 4, 64), [1, 17, 40, 300], [(0, 17), (16, 40), (100, 3)],
              sliding_window=sliding_window, num_splits=num_splits, fp8=fp8, transposed_values=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_fp8_dot_decode_matches_the_reference_on_fp8_queries(device, dtype, num_splits, sliding_window):
    """On the GPU only: Triton 3.9's interpreter rounds float32 to FP8 wrongly where the rounding carries into the
    exponent (127.9 to 64, not 128), which the queries' and probabilities' quantization meets."""
    _run_step(device, dtype, Shape(16, 2, 4, 64), [1, 17, 40, 300], [], sliding_window=sliding_window,
              num_splits=num_splits, fp8=True, transposed_values=True, fp8_dot=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("tiles", ["", "warp_split", "keys_first"])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["row-scales", "tensor-scales"])
def test_fp8_cache_rotary_decode_stores_what_rotary_write_stores(device, dtype, num_splits, tiles, per_tensor):
    """The decode kernel that rotates and stores the step's key quantizes it as rotary_write_kv_cache does, and
    attends over the cache as paged_decode_attention does (its value cache transposed within its pages, the other
    kernels' by rows: the stores follow the value cache's strides), in slices of keys a warp too, or with the keys
    first at keys_first_config's tiles (the engine's kernel_config.fp8_attention); with a scale per row or per
    tensor (the keys' and values' scales then cover only part of them: the rest saturates)."""
    from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq

    torch.manual_seed(5)
    batch, kv_heads, group, head_dim, page = 3, 2, 4, 64, 16
    q = torch.randn(batch, kv_heads * group, head_dim).to(device, dtype)
    k, v = (torch.randn(batch, kv_heads, head_dim).to(device, dtype) * 30 for _ in range(2))
    lens = torch.tensor([3, 20, 45], dtype=torch.int32, device=device)
    cos, sin = RotaryEmbedding(head_dim, 64, rope_inv_freq(head_dim, 10000.0)).to(device).cos_sin(
        (lens - 1).long(), dtype)
    table = torch.tensor([[1, 0, 0, 0], [2, 3, 0, 0], [4, 5, 6, 0]], dtype=torch.int32, device=device)
    slots = torch.stack([table[b, (lens[b] - 1) // page] * page + (lens[b] - 1) % page for b in range(batch)]).long()
    fused = list(quantize_fp8(torch.randn(7, page, kv_heads, head_dim).to(device)))
    if per_tensor:
        fused[1] = torch.tensor([0.05], device=device)
        fused[0] = quantize_fp8_by(torch.randn(7, page, kv_heads, head_dim).to(device) * 30, fused[1])
    fused = [fused[0], transposed_within_pages(fused[0]), fused[1], fused[1].clone() / (2 if per_tensor else 1)]
    split = [fused[0].clone(), fused[1].contiguous(), fused[2].clone(), fused[3].clone()]
    got = rotary_decode_attention(q, k, v, cos, sin, fused[0], fused[1], slots, table, lens, head_dim**-0.5,
                                  num_splits=num_splits, kv_scales=(fused[2], fused[3]),
                                  **({tiles: True} if tiles else {}))
    rotated_q = rotary_write_kv_cache(q, k, v, cos, sin, split[0], split[1], slots, kv_scales=(split[2], split[3]))
    expected = paged_decode_attention(rotated_q, split[0], split[1], table, lens, head_dim**-0.5,
                                      num_splits=num_splits, kv_scales=(split[2], split[3]))
    for mine, theirs in zip(fused, split):
        assert torch.equal(mine.contiguous().view(torch.uint8) if mine.dtype != torch.float32 else mine,
                           theirs.view(torch.uint8) if theirs.dtype != torch.float32 else theirs)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("transposed_values", [False, True], ids=["by-rows", "by-slots"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_fp8_cache_with_per_tensor_scales_matches_the_reference(device, dtype, transposed_values, num_splits,
                                                                 sliding_window):
    """kv_cache_config.fp8_scales='per_tensor': one scale for the keys, one for the values; decode and prefill
    over rows of magnitudes 0.01 to 100 (the small ones down to e4m3's subnormals)."""
    _run_step(device, dtype, Shape(16, 2, 4, 64), [1, 17, 40, 300], [(0, 17), (16, 40), (100, 3)],
              sliding_window=sliding_window, num_splits=num_splits, fp8=True, transposed_values=transposed_values,
              tensor_scales=True)


@pytest.mark.parametrize("tiles", [TileConfig(16, 64, 4, 3, warp_split=True),
                                   TileConfig(16, 128, 4, 3, keys_first=True)], ids=["warp-split", "keys-first"])
def test_per_tensor_scales_reach_the_slices_and_keys_first_tiles(device, tiles):
    _run_step(device, torch.float32, Shape(16, 2, 4, 64), [1, 17, 40, 300], [], num_splits=3, fp8=True,
              transposed_values=True, decode_tiles=tiles, tensor_scales=True)


def keys_by_heads(cache: torch.Tensor) -> torch.Tensor:
    """cache's contents in a cache stored head by head within its pages: [blocks, heads, slots, dims] in memory."""
    blocks, page, heads, dims = cache.shape
    stored = torch.empty((blocks, heads, page, dims), dtype=cache.dtype, device=cache.device).permute(0, 2, 1, 3)
    stored.view(torch.uint8).copy_(cache.view(torch.uint8))
    return stored


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-per-tensor"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_heads_first_grid_and_keys_by_heads_give_the_default_outputs(device, fp8, num_splits, head_dim):
    """TileConfig.heads_first (the grid's fastest dimension the KV head), a cap on registers (max_registers) and keys
    stored head by head within their pages change what runs side by side, what spills and where a tile's keys lie,
    not one sum: the outputs are the same bits, with heads that fill the tile (64 dimensions: unmasked) and heads that
    do not (48: masked)."""
    keys = torch.randn(40, 16, 2, head_dim, device=device)
    values = torch.randn(40, 16, 2, head_dim, device=device)
    scales = ()
    if fp8:
        scales = (torch.tensor([0.02], device=device), torch.tensor([0.01], device=device))
        keys, values = quantize_fp8_by(keys, scales[0]), transposed_within_pages(quantize_fp8_by(values, scales[1]))
    q = torch.randn(3, 8, head_dim, device=device)
    table = torch.randperm(40, device=device)[:30].view(3, 10).to(torch.int32)
    lens = torch.tensor([1, 77, 160], dtype=torch.int32, device=device)
    tiles = decode_config(64, 4, keys.element_size())

    def attend(k, v, config):
        return paged_decode_attention(q, k, v, table, lens, 0.125, num_splits=num_splits, kv_scales=scales,
                                      config=config)

    expected = attend(keys, values, tiles)
    torch.testing.assert_close(attend(keys, values, replace(tiles, heads_first=True)), expected, rtol=0, atol=0)
    torch.testing.assert_close(attend(keys, values, replace(tiles, max_registers=128)), expected, rtol=0, atol=0)
    by_heads_values = values if fp8 else keys_by_heads(values)  # by rows, values take the keys' strides
    torch.testing.assert_close(attend(keys_by_heads(keys), by_heads_values, tiles), expected, rtol=0, atol=0)


def test_fp8_cache_refuses_missing_or_misshapen_scales(device):
    cache, scale = quantize_fp8(torch.randn(3, 16, 2, 64, device=device))
    q = torch.randn(1, 2, 64, device=device)
    table, lens = torch.ones(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="an FP8 cache needs its"):
        paged_decode_attention(q, cache, cache, table, lens, 0.125)
    with pytest.raises(ValueError, match=r"k_scale must be float32 \[3, 16, 2\]"):
        paged_decode_attention(q, cache, cache, table, lens, 0.125, kv_scales=(scale[:, :8], scale))
    with pytest.raises(ValueError, match="a per-tensor v_scale must be float32"):
        paged_decode_attention(q, cache, cache, table, lens, 0.125,
                               kv_scales=(torch.ones(1, device=device), torch.ones(1, device=device).half()))
    with pytest.raises(ValueError, match="kv_scales go with an FP8 cache"):
        paged_decode_attention(q, cache.float(), cache.float(), table, lens, 0.125, kv_scales=(scale, scale))


def test_a_value_cache_neither_by_rows_nor_transposed_within_pages_is_refused(device):
    cache = torch.randn(3, 16, 2, 64, device=device)
    heads_last = torch.randn(3, 64, 16, 2, device=device).permute(0, 2, 3, 1)  # contiguous heads: neither layout
    q = torch.randn(1, 2, 64, device=device)
    table, lens = torch.ones(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"v_cache must have k_cache's strides \(2048, 128, 64, 1\) or contiguous"):
        paged_decode_attention(q, cache, heads_last, table, lens, 0.125)
    with pytest.raises(ValueError, match=r"v_cache must have k_cache's shape \[3, 16, 2, 64\]"):
        paged_decode_attention(q, cache, cache[:2], table, lens, 0.125)


def test_fp8_dot_is_refused_without_an_fp8_cache_by_slots_or_with_tiles_the_fp8_mma_cannot_take(device):
    cache, scale = quantize_fp8(torch.randn(3, 16, 2, 64, device=device))
    by_slots = transposed_within_pages(cache)
    q = torch.randn(1, 2, 64, device=device)
    table, lens = torch.ones(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="fp8_dot needs an FP8 cache with its values by slots.*values by rows"):
        paged_decode_attention(q, cache, cache, table, lens, 0.125, kv_scales=(scale, scale), fp8_dot=True)
    with pytest.raises(ValueError, match="fp8_dot needs .*kv_scales unset"):
        paged_decode_attention(q, cache.float(), cache.float(), table, lens, 0.125, fp8_dot=True)
    with pytest.raises(ValueError, match="fp8_dot needs .*block_n 32"):
        paged_decode_attention(q, cache, by_slots, table, lens, 0.125, kv_scales=(scale, scale), fp8_dot=True,
                               config=TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_keys_first_products_give_what_queries_first_give(device, dtype, num_splits):
    """TileConfig.keys_first on an FP8 cache with values by slots: the keys and values go first into the products,
    the group's queries padded to 8 rows; the outputs are the default order's up to the sums' order."""
    torch.manual_seed(5)
    cache, scale = quantize_fp8(torch.randn(40, 16, 2, 64, device=device))
    values, value_scale = quantize_fp8(torch.randn(40, 16, 2, 64, device=device))
    by_slots = transposed_within_pages(values)
    q = torch.randn(3, 8, 64, device=device).to(dtype)
    table = torch.randperm(39, device=device)[:36].add(1).view(3, 12).to(torch.int32)
    lens = torch.tensor([1, 77, 190], dtype=torch.int32, device=device)
    configs = [TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2, keys_first=first) for first in (0, 1)]
    outputs = [paged_decode_attention(q, cache, by_slots, table, lens, 0.125, num_splits=num_splits,
                                      kv_scales=(scale, value_scale), config=config) for config in configs]
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
