"""Split-K paged decode attention in Triton, rotating and storing the step's keys itself; its tile steps (the cache
layouts, the FP8 cache, values by slots) are in attention_tiles.py, chunked prefill over a cached prefix in
triton_prefill_attention.py, the other KV-cache writes in triton_kv_cache.py.

Query heads that share a KV head are processed by one program, so each K/V tile is read once per group; a
sequence's keys may be split over several programs (split-K), whose partial softmax states a second kernel merges.
The wrappers never read device values on the host, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from raylm.kernels.attention_tiles import (
    _LOG2_E,
    TileConfig,
    _attend_slices,
    _attend_tile,
    _attend_tile_keys_first,
    _dot_precision,
    _fp8_cache_queries,
    _load_kv_slices,
    _load_kv_tile,
    _merge_slices,
    _tensor_scales,
    _window,
)
from raylm.kernels.pdl import launch_options, pdl_wait
from raylm.kernels.triton_fp8 import fp8_scale, to_fp8
from raylm.kernels.triton_kv_cache import (
    cache_scales,
    check_cache,
    check_cache_write,
    check_value_cache,
    store_rows,
    value_strides,
)
from raylm.kernels.triton_ops import cos_sin_row, rope_rows, rotated_rows, rows_plus

# Split-K: each split should own at least this many keys, and there are never more splits than this.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Number of multiprocessors assumed when the tensors are not on a CUDA device (an H200 has 132).
_DEFAULT_SM_COUNT = 132


# ------------------------------------------------------------------------------------------ decode


# Arguments that change from step to step (batch composition, the widest block table) are not specialized on
# (Triton would otherwise compile a variant per value class: 1, a multiple of 16, other), so a new batch shape
# never stops a running engine to compile.
@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, window, num_q_heads, num_splits, head_dim,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_block, stride_slot, stride_head, stride_table,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    k_ptr, v_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_sin, k_scale_ptr, v_scale_ptr, stride_scale_block, stride_scale_slot, stride_scale_head,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DIRECT_OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ROPE: tl.constexpr = False, KV_FP8: tl.constexpr = False, USE_PDL: tl.constexpr = 0,
    V_BY_SLOTS: tl.constexpr = False, V_RUN: tl.constexpr = 16, FP8_DOT: tl.constexpr = False,
    KEYS_FIRST: tl.constexpr = False, WARP_SPLIT: tl.constexpr = 0, q_add_ptr=None, k_add_ptr=None, v_add_ptr=None,
    ADD: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False, EVEN_D: tl.constexpr = False,
):
    """One (sequence, KV head, split): attends the group's query heads over the split's range of keys.

    With ROPE, q holds the step's unrotated queries, and the kernel does what rotary_write_kv_cache does
    before it: it rotates the group's queries and, in the program whose split holds the newest key, stores
    the rotated key and the value (k, v) at the sequence's slot (none for a negative slot), then reads them
    back from the cache like every other key, after a barrier of the program's threads. With ADD, float32 addends
    laid out as q, k and v (a LoRA qkv layer's products: models/lora.py) join them as they load (rows_plus)."""
    if HEADS_FIRST:  # the grid is (KV heads, sequences, splits): a sequence's heads launch side by side
        seq = tl.program_id(1)
        kv_head = tl.program_id(0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)
    context_len = tl.load(context_lens_ptr + seq)
    first_key = tl.maximum(context_len - window, 0)
    # Each sequence divides its own visible range evenly, in whole tiles; trailing splits may be empty.
    keys_per_split = tl.cdiv(tl.cdiv(context_len - first_key, num_splits), BLOCK_N) * BLOCK_N
    split_start = first_key + split * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, context_len)

    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + groups
    head_mask = groups < GROUP
    if EVEN_D:  # the head fills BLOCK_D: no mask on its dimensions
        dim_mask = tl.full([BLOCK_D], True, tl.int1)
    else:
        dim_mask = dims < head_dim
    q_offsets = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_mask = head_mask[:, None] & dim_mask[None, :]
    if ROPE:
        half = head_dim // 2
        cos, sin = cos_sin_row(cos_ptr, sin_ptr, seq.to(tl.int64), stride_cos, stride_sin, dims, dim_mask)
        q = rotated_rows(q_ptr, q_offsets, dims, q_mask, cos, sin, half, q_add_ptr, ADD).to(q_ptr.dtype.element_ty)
        newest = context_len - 1
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if (newest >= split_start) & (newest < split_end) & (slot >= 0):
            kv_mask = dim_mask[None, :]
            row_mask = tl.full([1, 1], True, tl.int1)
            cache_row = ((slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot
                         + kv_head * stride_head + tl.zeros([1, 1], tl.int64))
            value_row = ((slot // PAGE_SIZE) * stride_v_block + (slot % PAGE_SIZE) * stride_v_slot
                         + kv_head * stride_v_head + tl.zeros([1, 1], tl.int64))
            scale_row = ((slot // PAGE_SIZE) * stride_scale_block + (slot % PAGE_SIZE) * stride_scale_slot
                         + kv_head * stride_scale_head + tl.zeros([1, 1], tl.int64))
            key = rotated_rows(k_ptr, seq.to(tl.int64) * stride_kt + kv_head * stride_kh, dims, kv_mask, cos, sin,
                               half, k_add_ptr, ADD)
            store_rows(k_cache_ptr, k_scale_ptr, key.to(k_ptr.dtype.element_ty), cache_row, scale_row, dims,
                       kv_mask, row_mask, 1, KV_FP8)
            value = rows_plus(v_ptr, v_add_ptr, seq.to(tl.int64) * stride_vt + kv_head * stride_vh + dims[None, :],
                              kv_mask, ADD).to(v_ptr.dtype.element_ty)
            store_rows(v_cache_ptr, v_scale_ptr, value, value_row, scale_row, dims, kv_mask, row_mask, stride_v_dim,
                       KV_FP8)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)
    # per-tensor scales of an FP8 cache: the keys' joins the scores' scale, the values' the output (1.0 otherwise)
    k_tensor, v_tensor = _tensor_scales(k_scale_ptr, v_scale_ptr, KV_FP8)
    if FP8_DOT:  # the queries in FP8 too, each head's row by its own scale, which joins qk_scale
        q_scale = fp8_scale(tl.max(tl.abs(q.to(tl.float32)), axis=1))
        q = to_fp8(q.to(tl.float32), q_scale[:, None])
        scores_scale = qk_scale * k_tensor * q_scale[None, :]
    else:
        q = _fp8_cache_queries(q, KV_FP8)
        scores_scale = qk_scale * k_tensor
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    if V_BY_SLOTS:  # tiles from the start of a run of V_RUN keys: the values load a run at a time (_load_kv_tile)
        tiles_start = split_start // V_RUN * V_RUN
    else:
        tiles_start = split_start
    if WARP_SPLIT:  # each tile in WARP_SPLIT slices of keys, a softmax state each (_attend_slices)
        SLICE: tl.constexpr = BLOCK_N // WARP_SPLIT
        q_slices = tl.broadcast_to(q[None, :, :], (WARP_SPLIT, BLOCK_G, BLOCK_D))
        slice_acc = tl.zeros([WARP_SPLIT, BLOCK_D, BLOCK_G], tl.float32)
        slice_m = tl.full([WARP_SPLIT, BLOCK_G], float("-inf"), tl.float32)
        slice_l = tl.zeros([WARP_SPLIT, BLOCK_G], tl.float32)
        slice_pos = tl.arange(0, WARP_SPLIT)[:, None] * SLICE + tl.arange(0, SLICE)[None, :]
        for tile_start in range(tiles_start, split_end, BLOCK_N):
            key_pos = tile_start + slice_pos
            key_mask = (key_pos >= split_start) & (key_pos < split_end)
            k, v_t, k_scale, v_scale = _load_kv_slices(
                k_cache_ptr, v_cache_ptr, table_row, key_pos, key_mask, kv_head, dims, dim_mask, stride_block,
                stride_slot, stride_head, stride_v_block, stride_v_slot, stride_v_head, stride_v_dim, k_scale_ptr,
                v_scale_ptr, stride_scale_block, stride_scale_slot, stride_scale_head, PAGE_SIZE, KV_FP8, V_RUN,
                split_end)
            slice_m, slice_l, slice_acc = _attend_slices(q_slices, k, v_t, k_scale, v_scale, key_mask, slice_m,
                                                         slice_l, slice_acc, scores_scale, DOT_PRECISION, KV_FP8)
        m_i, l_i, acc = _merge_slices(slice_m, slice_l, slice_acc)
    else:
        if KEYS_FIRST:
            acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)  # transposed (_attend_tile_keys_first)
        else:
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        for tile_start in range(tiles_start, split_end, BLOCK_N):
            key_pos = tile_start + tl.arange(0, BLOCK_N)
            if V_BY_SLOTS:
                key_mask = (key_pos >= split_start) & (key_pos < split_end)
            else:
                key_mask = key_pos < split_end
            k, v, k_scale, v_scale = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, key_pos, key_mask, kv_head,
                                                   dims, dim_mask, stride_block, stride_slot, stride_head,
                                                   stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
                                                   k_scale_ptr, v_scale_ptr, stride_scale_block, stride_scale_slot,
                                                   stride_scale_head, PAGE_SIZE, KV_FP8, V_BY_SLOTS, V_RUN, split_end)
            if KEYS_FIRST:
                m_i, l_i, acc = _attend_tile_keys_first(q, k, v, k_scale, v_scale, key_mask, m_i, l_i, acc,
                                                        scores_scale, DOT_PRECISION, FP8_DOT, KV_FP8)
            else:
                m_i, l_i, acc = _attend_tile(q, k, v, k_scale, v_scale, key_mask[None, :], m_i, l_i, acc,
                                             scores_scale, True, DOT_PRECISION, KV_FP8, True)
    if KEYS_FIRST:
        acc = tl.trans(acc)
    if KV_FP8 == 2:
        acc = acc * v_tensor

    if DIRECT_OUTPUT:
        # A sequence with no keys (context_len 0, e.g. CUDA-graph padding) gets zeros, not NaN.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
    else:
        part_rows = (seq.to(tl.int64) * num_q_heads + heads) * num_splits + split
        tl.store(part_max_ptr + part_rows, m_i, mask=head_mask)
        tl.store(part_sum_ptr + part_rows, l_i, mask=head_mask)
        tl.store(part_acc_ptr + part_rows[:, None] * head_dim + dims[None, :], acc,
                 mask=head_mask[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_q_heads, num_splits, head_dim,
                          stride_ob, stride_oh, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_PDL: tl.constexpr = 0):
    """Merges the splits of one (sequence, query head) by their log-sum-exp weights."""
    pdl_wait(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    dim_mask = dims < head_dim
    part_rows = (seq.to(tl.int64) * num_q_heads + head) * num_splits + splits
    split_max = tl.load(part_max_ptr + part_rows, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part_rows, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part_rows[:, None] * head_dim + dims[None, :],
                  mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    overall_max = tl.max(split_max, axis=0)
    weights = tl.exp2(split_max - tl.where(overall_max == float("-inf"), 0.0, overall_max))
    total = tl.sum(weights * split_sum, axis=0)
    out = tl.sum(weights[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def decode_config(head_dim: int, query_size: int, cache_size: int) -> TileConfig:
    """Decode tiles for queries and a cache of those element sizes (bytes); block_m is the minimum rows of tl.dot,
    filled by the GQA group as far as it goes.

    Chosen by sweeps on an H200 (page 16, benchmarks/attention.py): for bf16 about 4.3 TB/s at batch 64 x 4096
    keys (d128); an FP8 cache's tiles hold twice the keys in the same bytes (2.58 TB/s at 512 x 1024 with values
    by slots, against 1.61 at bf16's tiles). Float32 tiles hold half the keys, so that the pipelined K/V stages
    fit in shared memory (an FP8 cache's too, under float32 queries: its tiles widen to float32 in registers).
    """
    if head_dim <= 64:
        block_n, stages = 128, 3
    elif head_dim <= 128:
        block_n, stages = 64, 3
    else:
        block_n, stages = 32, 2
    if query_size > 2 or cache_size > 2:
        block_n //= 2
    elif cache_size == 1:
        block_n = min(2 * block_n, 128)
    return TileConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=stages)


def keys_first_config(head_dim: int) -> TileConfig:
    """Decode tiles over an FP8 cache (16-bit queries, values by slots) with the keys and values first in the
    products (kernel_config.fp8_attention 'float16_keys_first'): the GQA group's queries padded to 8 columns, not 16
    rows, read from shared memory as the products' second operand. 2 warps and 64 keys (d128): on sm_90, 16.9 warp
    instructions a key with per-tensor scales and 20.6 with row scales, against 25.1 and 28.7 at decode_config's
    tiles (register moves assembling the queries' operand quads: 45 a tile against 181), no spills."""
    return TileConfig(block_m=16, block_n=64 if head_dim <= 128 else 32, num_warps=2, num_stages=2, keys_first=True)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch_size: int, num_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Splits per sequence for split-K decode: enough (sequence, KV head, split) programs for about two
    waves over the GPU's multiprocessors, but no split shorter than _MIN_KEYS_PER_SPLIT keys.

    max_keys bounds the visible keys of any sequence; it comes from shapes, so the choice needs no sync.
    """
    programs = max(batch_size * num_kv_heads, 1)
    for_occupancy = triton.cdiv(2 * _sm_count(device), programs)
    for_length = triton.cdiv(max_keys, _MIN_KEYS_PER_SPLIT)
    return max(1, min(for_occupancy, for_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    pdl: int = 0,
    kv_scales: tuple[torch.Tensor, ...] = (),
    config: TileConfig | None = None,
    fp8_dot: bool = False,
    warp_split: bool = False,
    keys_first: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; returns [B, H_q, D] in q's dtype.

    q: [B, H_q, D], the token at position context_lens[b] - 1 (its key and value already in the cache);
    caches: [num_blocks, block_size, H_kv, D] with H_q a multiple of H_kv; block_tables: [B, max_blocks]
    int32; context_lens: [B] int32 or int64, keys per sequence including the current one. A sliding window
    hides keys at positions < context_len - sliding_window. A sequence with context_len 0 gets zeros.
    num_splits partitions each context for split-K (chosen from the shapes when None; 1 disables it). `pdl`: the
    launches' trigger mode (kernels/pdl.py). kv_scales: an FP8 cache's (k_scale, v_scale). `config` fixes the
    tiles instead of decode_config's (for benchmarks; block_m is raised to the GQA group's power of two). fp8_dot
    (an FP8 cache with its values by slots): the products run on FP8 tensor cores, the queries and probabilities
    quantized to FP8 too (_attend_tile_keys_first). warp_split (values by slots): the tiles cut into a slice of
    keys a warp (TileConfig.warp_split). keys_first (an FP8 cache with its values by slots): the keys and values
    first in the products, at keys_first_config's tiles unless `config` says others.
    """
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, None, pdl,
                   kv_scales, config, fp8_dot, warp_split, keys_first)


def rotary_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    pdl: int = 0,
    kv_scales: tuple[torch.Tensor, ...] = (),
    fp8_dot: bool = False,
    warp_split: bool = False,
    addends: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    keys_first: bool = False,
) -> torch.Tensor:
    """rotary_write_kv_cache then paged_decode_attention in one kernel launch (two with split-K): q, k [B, H, D]
    are the step's unrotated queries and keys, v its values, cos / sin one row per sequence; the rotated keys
    and the values are stored at slot_mapping's slots (not for negative slots), and the result is the
    attention of the rotated queries over the contexts, the new keys included. addends: float32 tensors of q, k
    and v's shapes and strides (a LoRA qkv layer's products) added to them first, each sum rounded to their dtype
    as q.add_(addends[0]) would leave it, so that the layer needs no add of its own."""
    batch, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cos_rows, sin_rows = rope_rows(q, k, cos, sin)
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous in their last dimension")
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k has {num_kv_heads} heads, the cache {k_cache.shape[2]}")
    if addends is not None:
        for name, tensor, addend in zip("qkv", (q, k, v), addends):
            if addend.dtype != torch.float32 or addend.shape != tensor.shape or addend.stride() != tensor.stride():
                raise ValueError(f"the addends of {name} must be float32 of its shape {list(tensor.shape)} and "
                                 f"strides {tensor.stride()}, got {addend.dtype} {list(addend.shape)} "
                                 f"{addend.stride()}")
    rope = (k, v, cos_rows, sin_rows, slot_mapping, addends)
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, rope, pdl,
                   kv_scales, None, fp8_dot, warp_split, keys_first)


def _decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, rope, pdl,
            kv_scales, config=None, fp8_dot=False, warp_split=False, keys_first=False):
    """The decode attention launch of paged_decode_attention, and of rotary_decode_attention with rope =
    (k, v, cos_rows, sin_rows, slot_mapping, addends or None)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_cache("k_cache", k_cache, num_kv_heads, head_dim)
    check_value_cache(v_cache, k_cache)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of the cache's KV heads ({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables must be [{batch}, max_blocks] and context_lens [{batch}], got "
                         f"{list(block_tables.shape)} and {list(context_lens.shape)}")
    if q.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q and block_tables must be contiguous in their last dimension")
    k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head, fp8 = cache_scales(k_cache, kv_scales)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    window = _window(sliding_window)
    page_size = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        max_keys = min(block_tables.shape[1] * page_size, window)
        num_splits = choose_num_splits(batch, num_kv_heads, max_keys, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_d = triton.next_power_of_2(head_dim)
    if keys_first and not fp8_dot:
        config = dataclasses.replace(config, keys_first=True) if config else keys_first_config(block_d)
    # FP8 products take the queries in FP8: the tiles stay FP8 whatever the queries' dtype.
    config = config or decode_config(block_d, 2 if fp8_dot else q.element_size(), k_cache.element_size())
    if warp_split:  # a slice of at least 16 keys a warp (the products' reduction)
        config = dataclasses.replace(config, warp_split=True, block_n=max(config.block_n, 16 * config.num_warps))
    values_by_slots = v_cache.stride() != k_cache.stride()
    if fp8_dot and not (fp8 and values_by_slots and config.block_n % 64 == 0 and head_dim >= 32):
        raise ValueError(f"fp8_dot needs an FP8 cache with its values by slots, tiles of a multiple of 64 keys (the "
                         f"FP8 MMA's rows) and heads of at least 32 dimensions (its reduction); got kv_scales "
                         f"{'set' if fp8 else 'unset'}, values {'by slots' if values_by_slots else 'by rows'}, "
                         f"block_n {config.block_n}, head_dim {head_dim}")
    if config.keys_first and not (fp8 and values_by_slots):
        raise ValueError("keys_first tiles need an FP8 cache with its values by slots")
    run = math.gcd(page_size, config.block_n, 16)
    if config.warp_split and not (values_by_slots and not fp8_dot and not config.keys_first
                                  and config.block_n % (config.num_warps * max(16, run)) == 0):
        raise ValueError(f"warp_split tiles need values by slots, no FP8 products or keys first, and block_n a "
                         f"multiple of 16 keys (and of the value runs) per warp; got values "
                         f"{'by slots' if values_by_slots else 'by rows'}, block_n {config.block_n}, "
                         f"{config.num_warps} warps")
    if config.heads_first and batch > 65535:  # a grid's second dimension
        raise ValueError(f"heads_first tiles take at most 65535 sequences, got {batch}")
    keys_first = fp8_dot or config.keys_first
    direct = num_splits == 1
    if direct:
        part_acc = part_max = part_sum = out  # unused by the kernel
    else:
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    if rope is None:  # the rotation's arguments are unused: any tensors
        k, v, cos, sin, slots, addends = q, q, q, q, context_lens, None
    else:
        k, v, cos, sin, slots, addends = rope
    grid = (num_kv_heads, batch, num_splits) if config.heads_first else (batch, num_kv_heads, num_splits)
    _decode_split_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        scale * _LOG2_E, window, num_q_heads, num_splits, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *value_strides(v_cache),
        k, v, cos, sin, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head,
        GROUP=group, BLOCK_G=max(8 if keys_first else config.block_m, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=config.block_n, PAGE_SIZE=page_size, DIRECT_OUTPUT=direct, DOT_PRECISION=_dot_precision(q.dtype),
        ROPE=rope is not None, KV_FP8=fp8, V_BY_SLOTS=values_by_slots, V_RUN=run, FP8_DOT=fp8_dot,
        KEYS_FIRST=keys_first, WARP_SPLIT=config.num_warps if config.warp_split else 0,
        q_add_ptr=q if addends is None else addends[0], k_add_ptr=k if addends is None else addends[1],
        v_add_ptr=v if addends is None else addends[2], ADD=addends is not None, HEADS_FIRST=config.heads_first,
        EVEN_D=head_dim == block_d,  # no mask on the dimensions: 4 programs an SM, not 3 (sm_90, FP8 per-tensor)
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
    )
    if not direct:  # one BLOCK_S for every split count up to _MAX_SPLITS: one compiled variant
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_acc, part_max, part_sum, num_q_heads, num_splits, head_dim, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(max(num_splits, _MAX_SPLITS)), BLOCK_D=block_d, num_warps=4,
            **launch_options(pdl),
        )
    return out
