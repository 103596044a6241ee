"""Paged attention in Triton: the tile steps both attention kernels share, and split-K decode (rotating and storing
the step's keys itself); chunked prefill over a cached prefix is in triton_prefill_attention.py, the other KV-cache
writes in triton_kv_cache.py.

The cache layout is the torch reference's (kernels/attention.py): [num_blocks, block_size, H_kv, D] for keys
and for values, a sequence's positions mapped to blocks through its row of the block table. Every kernel
gathers a tile of keys one row at a time (row = one position of one KV head, D contiguous elements), so a
tile may span several cache blocks and its size is chosen for the GPU, not by the cache's block size.

An FP8 cache (float8_e4m3fn rows, a float32 scale per row beside them: triton_kv_cache.py) is read as it is
stored: each tile widened to float16 (one conversion per two values; to bfloat16 it takes three), the 16-bit
queries rounded to float16 once per program. The keys' scales go on the scores; the values' weigh the
probabilities before they multiply the values (both scales belong to a key, a column of the tile), divided by the
tile's largest first so that the float16 weights keep their precision whatever the scales' magnitude, that largest
scale multiplying the tile's product. Float32 queries (the CPU's models) widen the tiles to float32 instead.
The value cache has strides of its own (by rows as the keys, or transposed within its pages: triton_kv_cache.py).
Compiled for sm_90 by Triton 3.9, values by rows stay in shared memory and their operand (whose reduction runs along
keys) is assembled from 64 one-byte loads a thread per tile; values transposed within their pages (the engine's
layout for an FP8 cache) are read in whole runs of 16 keys of a page (tiles start at a run's start; keys outside
the split are masked in the scores), 16 bytes a load through cp.async as the keys' are. On the H200, at 512 x 1024
keys: 2.56 TB/s against 2.06 by rows and 3.94 for bf16 (docs/benchmarks.md). A run can read slots past a
sequence's end, weighted 0: a value cache stored that way must hold finite values there (zeroed when allocated).
With fp8_dot, the FP8 tiles are multiplied as stored by Hopper's warpgroup MMA (_attend_tile_keys_first), the
queries and probabilities quantized to FP8.

Query heads that share a KV head are processed by one program, so each K/V tile is read once per group.
Scores are accumulated in float32 and the softmax runs online in base 2 (exp2 of scores scaled by log2 e).
The wrappers never read device values on the host, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
from raylm.kernels.triton_ops import cos_sin_row, rope_rows, rotated_rows

_LOG2_E = 1.4426950408889634
# Stands for "no sliding window": larger than any context, small enough that position - window fits int32.
_NO_WINDOW = 1 << 30
# Split-K: each split should own at least this many keys, and there are never more splits than this.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Number of multiprocessors assumed when the tensors are not on a CUDA device (an H200 has 132).
_DEFAULT_SM_COUNT = 132
_FLOAT16_MAX = tl.constexpr(65504.0)
# FP8 probabilities span [0, _WEIGHT_SPAN] (e4m3 reaches 448): their small values keep more bits than in [0, 1].
_WEIGHT_SPAN = tl.constexpr(256.0)


# ------------------------------------------------------------------------------------------ shared parts


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_row_ptr, key_pos, key_mask, kv_head, dims, dim_mask,
                  stride_block, stride_slot, stride_head, stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
                  k_scale_ptr, v_scale_ptr, stride_scale_block, stride_scale_slot, stride_scale_head,
                  PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, V_BY_SLOTS: tl.constexpr, V_RUN: tl.constexpr,
                  run_end):
    """The keys and values at `key_pos` of one KV head, read through a sequence's block table (zeros where
    key_mask is false), and an FP8 cache's scales of those keys and values (1.0 for another cache). The values are
    stored by rows with the keys' strides, or transposed within their pages (V_BY_SLOTS, strides stride_v_*).

    V_RUN > 0 (values by slots, key_pos starting at a multiple of V_RUN, a divisor of the page): the values are
    read in whole runs of V_RUN keys of one page, every run that starts before run_end, so that each thread's load
    is a vector. Keys of a run past key_mask get their slots' values (finite: written, or the cache's zeros) and
    zero weight in _attend_tile, as their scales load as 0. The block table is read once for keys and values (for
    every key of those runs: the keys' own loads stay masked by key_mask)."""
    if V_BY_SLOTS and V_RUN > 0:
        run_mask = key_pos // V_RUN * V_RUN < run_end
        table_mask = run_mask
    else:
        table_mask = key_mask
    block_id = tl.load(block_table_row_ptr + key_pos // PAGE_SIZE, mask=table_mask, other=0).to(tl.int64)
    slot = key_pos % PAGE_SIZE
    rows = block_id * stride_block + slot * stride_slot + kv_head * stride_head
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if V_BY_SLOTS:  # loaded [dims, keys] as stored, then transposed: the dot reads it along keys, its reduction
        if V_RUN > 0:
            v_rows = block_id * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
            v_rows = tl.max_contiguous(tl.multiple_of(v_rows, [V_RUN]), [V_RUN])
            v_mask = dim_mask[:, None] & run_mask[None, :]
        else:
            v_rows = block_id * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
            v_mask = dim_mask[:, None] & key_mask[None, :]
        v = tl.trans(tl.load(v_cache_ptr + v_rows[None, :] + dims[:, None] * stride_v_dim, mask=v_mask, other=0.0))
    else:  # by rows, at the keys' offsets (check_value_cache: the same strides)
        v = tl.load(v_cache_ptr + rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if KV_FP8:
        scale_rows = (block_id * stride_scale_block + (key_pos % PAGE_SIZE) * stride_scale_slot
                      + kv_head * stride_scale_head)
        k_scale = tl.load(k_scale_ptr + scale_rows, mask=key_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_rows, mask=key_mask, other=0.0)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k, v, k_scale, v_scale


@triton.jit
def _fp8_cache_queries(q, KV_FP8: tl.constexpr):
    """The queries as an FP8 cache's tiles meet them: 16-bit queries rounded to float16 (held within its range),
    float32 ones as they are; any queries as they are for another cache."""
    if KV_FP8:
        if q.dtype != tl.float32:
            q = tl.clamp(q.to(tl.float32), -_FLOAT16_MAX, _FLOAT16_MAX).to(tl.float16)
    return q


@triton.jit
def _max_pair(a, b, c, d):
    return tl.maximum(a, c), tl.maximum(b, d)


@triton.jit
def _attend_tile(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, KEYS_ACROSS_WARPS: tl.constexpr = False):
    """One online-softmax step over a tile of keys: returns the updated (row max, row sum, accumulator). An FP8
    tile's keys and values are widened to q's dtype (float16 or float32: _fp8_cache_queries), their scales (per
    key) applied to the scores and to the probabilities that weigh the values.

    With MASKED, scores where `visible` is false are dropped; rows that see no key yet keep max -inf and
    their probabilities are computed against 0, so that no NaN (from -inf - -inf) enters the sums.
    KEYS_ACROSS_WARPS (decode: a few query rows, the tile's keys spread over the warps): the value scales' maximum
    joins the scores' in one reduction, one exchange between warps fewer; where each warp holds whole rows of keys
    (prefill) it stays a reduction of its own, which crosses no warp.
    """
    if KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if KV_FP8:
        scores = scores * k_scale[None, :]
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    if KV_FP8 and KEYS_ACROSS_WARPS:
        tile_max, top = tl.reduce((scores, tl.broadcast_to(v_scale[None, :], scores.shape)), 1, _max_pair)
    else:
        tile_max = tl.max(scores, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_FP8 and KEYS_ACROSS_WARPS:  # top per row, all rows alike
        top = tl.where(top > 0.0, top, 1.0)
        weights = (p * v_scale[None, :] * (1.0 / top)[:, None]).to(v.dtype)
        acc = tl.dot(weights, v, acc=acc * (alpha / top)[:, None], input_precision=DOT_PRECISION) * top[:, None]
    elif KV_FP8:
        top = tl.max(v_scale, axis=0)
        top = tl.where(top > 0.0, top, 1.0)
        weights = (p * (v_scale / top)[None, :]).to(v.dtype)
        acc = tl.dot(weights, v, acc=acc * (alpha / top)[:, None], input_precision=DOT_PRECISION) * top
    else:
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_keys_first(q, k, v, k_scale, v_scale, key_mask, m_i, l_i, acc_t, qk_scale,
                            DOT_PRECISION: tl.constexpr, FP8_DOT: tl.constexpr):
    """_attend_tile on an FP8 cache with its values by slots, transposed: keys [N, D] and the values' transpose
    [D, N] are the products' first operands, whose rows the tensor cores take 16 (64 for the warpgroup MMA) at a
    time, the GQA group's queries [G, D] and probabilities [G, N] the second, whose G needs padding to 8 only, not
    16. Scores are [N, G], the accumulator acc_t [D, G]; qk_scale [1, G] or a scalar. With FP8_DOT the FP8 tiles
    are multiplied as stored (the queries in FP8, the probabilities rounded to FP8 over [0, _WEIGHT_SPAN]);
    otherwise widened to q's dtype, as _attend_tile does."""
    if not FP8_DOT:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale * k_scale[:, None]
    scores = tl.where(key_mask[:, None], scores, float("-inf"))
    # the scores' and the value scales' maxima in one reduction (one exchange between warps, not two)
    tile_max, top = tl.reduce((scores, tl.broadcast_to(v_scale[:, None], scores.shape)), 0, _max_pair)
    m_new = tl.maximum(m_i, tile_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[None, :])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    top = tl.where(top > 0.0, top, 1.0)
    if FP8_DOT:
        top = top / _WEIGHT_SPAN
    weights = (p * v_scale[:, None] * (1.0 / top)[None, :]).to(v.dtype)
    acc_t = tl.dot(tl.trans(v), weights, acc=acc_t * (alpha / top)[None, :], input_precision=DOT_PRECISION)
    acc_t = acc_t * top[None, :]
    return m_new, l_i, acc_t


@triton.jit
def _load_kv_slices(k_cache_ptr, v_cache_ptr, block_table_row_ptr, key_pos, key_mask, kv_head, dims, dim_mask,
                    stride_block, stride_slot, stride_head, stride_v_block, stride_v_slot, stride_v_head,
                    stride_v_dim, k_scale_ptr, v_scale_ptr, stride_scale_block, stride_scale_slot, stride_scale_head,
                    PAGE_SIZE: tl.constexpr, KV_FP8: tl.constexpr, V_RUN: tl.constexpr, run_end):
    """_load_kv_tile for a tile cut into slices, one a warp (_attend_slices): key_pos and key_mask [W, NW]; the
    keys [W, NW, D], the values' transpose [W, D, NW] as stored by slots (read in whole runs of V_RUN keys, a slice
    holding whole runs), and an FP8 cache's scales [W, NW] (1.0 for another cache)."""
    run_mask = key_pos // V_RUN * V_RUN < run_end
    block_id = tl.load(block_table_row_ptr + key_pos // PAGE_SIZE, mask=run_mask, other=0).to(tl.int64)
    slot = key_pos % PAGE_SIZE
    rows = block_id * stride_block + slot * stride_slot + kv_head * stride_head
    k = tl.load(k_cache_ptr + rows[:, :, None] + dims[None, None, :],
                mask=key_mask[:, :, None] & dim_mask[None, None, :], other=0.0)
    v_rows = block_id * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
    v_rows = tl.max_contiguous(tl.multiple_of(v_rows, [1, V_RUN]), [1, V_RUN])
    v_t = tl.load(v_cache_ptr + v_rows[:, None, :] + dims[None, :, None] * stride_v_dim,
                  mask=dim_mask[None, :, None] & run_mask[:, None, :], other=0.0)
    if KV_FP8:
        scale_rows = block_id * stride_scale_block + slot * stride_scale_slot + kv_head * stride_scale_head
        k_scale = tl.load(k_scale_ptr + scale_rows, mask=key_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_rows, mask=key_mask, other=0.0)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k, v_t, k_scale, v_scale


@triton.jit
def _attend_slices(q, k, v_t, k_scale, v_scale, key_mask, m_i, l_i, acc_t, qk_scale, DOT_PRECISION: tl.constexpr,
                   KV_FP8: tl.constexpr):
    """_attend_tile over a tile cut into W slices of keys, each with a softmax state of its own: q [W, G, D] (the
    group's queries, repeated), keys [W, NW, D], the values' transpose [W, D, NW], scales and key_mask [W, NW];
    m_i, l_i [W, G], the accumulator acc_t [W, D, G]. The products are batched over the slices, which the compiler
    gives a warp each, so that the reductions over keys stay within a warp: no exchange through shared memory
    between warps in the loop (sm_90: 4 barriers a 128-key tile against 11), one merge after it (_merge_slices)."""
    k = k.to(q.dtype)
    v_t = v_t.to(q.dtype)
    scores = tl.dot(q, tl.trans(k, (0, 2, 1)), input_precision=DOT_PRECISION) * qk_scale
    if KV_FP8:
        scores = scores * k_scale[:, None, :]
    scores = tl.where(key_mask[:, None, :], scores, float("-inf"))
    if KV_FP8:
        tile_max, top = tl.reduce((scores, tl.broadcast_to(v_scale[:, None, :], scores.shape)), 2, _max_pair)
    else:
        tile_max = tl.max(scores, axis=2)
    m_new = tl.maximum(m_i, tile_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[:, :, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=2)
    if KV_FP8:
        top = tl.where(top > 0.0, top, 1.0)
        weights = (p * v_scale[:, None, :] * (1.0 / top)[:, :, None]).to(v_t.dtype)
        acc_t = tl.dot(v_t, tl.trans(weights, (0, 2, 1)), acc=acc_t * (alpha / top)[:, None, :],
                       input_precision=DOT_PRECISION)
        acc_t = acc_t * top[:, None, :]
    else:
        acc_t = tl.dot(v_t, tl.trans(p.to(v_t.dtype), (0, 2, 1)), acc=acc_t * alpha[:, None, :],
                       input_precision=DOT_PRECISION)
    return m_new, l_i, acc_t


@triton.jit
def _merge_slices(m_i, l_i, acc_t):
    """The slices' softmax states [W, G], [W, G], [W, D, G] as one: row max and sum [G], accumulator [G, D]."""
    m_all = tl.max(m_i, axis=0)
    weights = tl.exp2(m_i - tl.where(m_all == float("-inf"), 0.0, m_all)[None, :])
    return m_all, tl.sum(l_i * weights, axis=0), tl.trans(tl.sum(acc_t * weights[:, None, :], axis=0))


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be multiplied in TF32 on the GPU (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def _window(sliding_window: int | None) -> int:
    if sliding_window is None:
        return _NO_WINDOW
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    return min(sliding_window, _NO_WINDOW)


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
    KEYS_FIRST: tl.constexpr = False, WARP_SPLIT: tl.constexpr = 0,
):
    """One (sequence, KV head, split): attends the group's query heads over the split's range of keys.

    With ROPE, q holds the step's unrotated queries, and the kernel does what rotary_write_kv_cache does
    before it: it rotates the group's queries and, in the program whose split holds the newest key, stores
    the rotated key and the value (k, v) at the sequence's slot (none for a negative slot), then reads them
    back from the cache like every other key, after a barrier of the program's threads."""
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
    dim_mask = dims < head_dim
    q_offsets = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q_mask = head_mask[:, None] & dim_mask[None, :]
    if ROPE:
        half = head_dim // 2
        cos, sin = cos_sin_row(cos_ptr, sin_ptr, seq.to(tl.int64), stride_cos, stride_sin, dims, dim_mask)
        q = rotated_rows(q_ptr, q_offsets, dims, q_mask, cos, sin, half).to(q_ptr.dtype.element_ty)
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
                               half)
            store_rows(k_cache_ptr, k_scale_ptr, key.to(k_ptr.dtype.element_ty), cache_row, scale_row, dims,
                       kv_mask, row_mask, 1, KV_FP8)
            value = tl.load(v_ptr + seq.to(tl.int64) * stride_vt + kv_head * stride_vh + dims[None, :], mask=kv_mask,
                            other=0.0)
            store_rows(v_cache_ptr, v_scale_ptr, value, value_row, scale_row, dims, kv_mask, row_mask, stride_v_dim,
                       KV_FP8)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + q_offsets + dims[None, :], mask=q_mask, other=0.0)
    if FP8_DOT:  # the queries in FP8 too, each head's row by its own scale, which joins qk_scale
        q_scale = fp8_scale(tl.max(tl.abs(q.to(tl.float32)), axis=1))
        q = to_fp8(q.to(tl.float32), q_scale[:, None])
        scores_scale = qk_scale * q_scale[None, :]
    else:
        q = _fp8_cache_queries(q, KV_FP8)
        scores_scale = qk_scale
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
                                                        scores_scale, DOT_PRECISION, FP8_DOT)
            else:
                m_i, l_i, acc = _attend_tile(q, k, v, k_scale, v_scale, key_mask[None, :], m_i, l_i, acc,
                                             scores_scale, True, DOT_PRECISION, KV_FP8, True)
    if KEYS_FIRST:
        acc = tl.trans(acc)

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


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of an attention kernel (block_m: query rows; block_n: keys). keys_first
    (decode over an FP8 cache with its values by slots): the keys and values are the products' first operands
    (_attend_tile_keys_first), the query rows padded to 8, not block_m. warp_split (decode over a cache with its
    values by slots): each tile cut into num_warps slices of keys with a softmax state each (_attend_slices)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    keys_first: bool = False
    warp_split: bool = False


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
    keys a warp (TileConfig.warp_split).
    """
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, None, pdl,
                   kv_scales, config, fp8_dot, warp_split)


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
) -> torch.Tensor:
    """rotary_write_kv_cache then paged_decode_attention in one kernel launch (two with split-K): q, k [B, H, D]
    are the step's unrotated queries and keys, v its values, cos / sin one row per sequence; the rotated keys
    and the values are stored at slot_mapping's slots (not for negative slots), and the result is the
    attention of the rotated queries over the contexts, the new keys included."""
    batch, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cos_rows, sin_rows = rope_rows(q, k, cos, sin)
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous in their last dimension")
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k has {num_kv_heads} heads, the cache {k_cache.shape[2]}")
    rope = (k, v, cos_rows, sin_rows, slot_mapping)
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, rope, pdl,
                   kv_scales, None, fp8_dot, warp_split)


def _decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, rope, pdl,
            kv_scales, config=None, fp8_dot=False, warp_split=False):
    """The decode attention launch of paged_decode_attention, and of rotary_decode_attention with rope =
    (k, v, cos_rows, sin_rows, slot_mapping)."""
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
    keys_first = fp8_dot or config.keys_first
    direct = num_splits == 1
    if direct:
        part_acc = part_max = part_sum = out  # unused by the kernel
    else:
        part_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    if rope is None:  # the rotation's arguments are unused: any tensors
        k, v, cos, sin, slots = q, q, q, q, context_lens
    else:
        k, v, cos, sin, slots = rope
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_max, part_sum,
        scale * _LOG2_E, window, num_q_heads, num_splits, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *value_strides(v_cache),
        k, v, cos, sin, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head,
        GROUP=group, BLOCK_G=max(8 if keys_first else config.block_m, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=config.block_n, PAGE_SIZE=page_size, DIRECT_OUTPUT=direct, DOT_PRECISION=_dot_precision(q.dtype),
        ROPE=rope is not None, KV_FP8=fp8, V_BY_SLOTS=values_by_slots, V_RUN=run, FP8_DOT=fp8_dot,
        KEYS_FIRST=keys_first, WARP_SPLIT=config.num_warps if config.warp_split else 0, num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    if not direct:  # one BLOCK_S for every split count up to _MAX_SPLITS: one compiled variant
        _decode_reduce_kernel[(batch, num_q_heads)](
            out, part_acc, part_max, part_sum, num_q_heads, num_splits, head_dim, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(max(num_splits, _MAX_SPLITS)), BLOCK_D=block_d, num_warps=4,
            **launch_options(pdl),
        )
    return out
