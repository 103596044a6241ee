"""Paged attention's tile steps in Triton, shared by the decode kernels (triton_attention.py) and chunked prefill
(triton_prefill_attention.py): a tile of keys read through a sequence's block table, and one online-softmax step
over it; the tile sizes (TileConfig).

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
queries and probabilities quantized to FP8. A decode tile may also be cut into a slice of keys a warp, each with
its own softmax state (_attend_slices), so that its reductions over keys stay within a warp.

An FP8 cache with per-tensor scales (KV_FP8 == TENSOR_SCALES: triton_kv_cache.py) loads no scale a key: the
keys' one scale joins qk_scale and the values' multiplies the output (_tensor_scales), so its tiles take
_attend_tile's steps of a 16-bit cache once widened.

Scores are accumulated in float32 and the softmax runs online in base 2 (exp2 of scores scaled by log2 e).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2_E = 1.4426950408889634
# Stands for "no sliding window": larger than any context, small enough that position - window fits int32.
_NO_WINDOW = 1 << 30
_FLOAT16_MAX = tl.constexpr(65504.0)
# FP8 probabilities span [0, _WEIGHT_SPAN] (e4m3 reaches 448): their small values keep more bits than in [0, 1].
_WEIGHT_SPAN = tl.constexpr(256.0)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of an attention kernel (block_m: query rows; block_n: keys). keys_first
    (decode over an FP8 cache with its values by slots): the keys and values are the products' first operands
    (_attend_tile_keys_first), the query rows padded to 8, not block_m. warp_split (decode over a cache with its
    values by slots): each tile cut into num_warps slices of keys with a softmax state each (_attend_slices).
    heads_first (decode): the launch grid's fastest dimension is the KV head, so that a sequence's heads run side by
    side and read the same pages together. max_registers (0: the compiler's choice): a cap on a thread's registers
    (ptxas spills what does not fit), e.g. 128 for 4 programs of 4 warps an SM."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    keys_first: bool = False
    warp_split: bool = False
    heads_first: bool = False
    max_registers: int = 0


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
    k_scale, v_scale = _load_kv_scales(k_scale_ptr, v_scale_ptr, block_id, slot, kv_head, key_mask,
                                       stride_scale_block, stride_scale_slot, stride_scale_head, KV_FP8)
    return k, v, k_scale, v_scale


@triton.jit
def _load_kv_scales(k_scale_ptr, v_scale_ptr, block_id, slot, kv_head, key_mask, stride_scale_block,
                    stride_scale_slot, stride_scale_head, KV_FP8: tl.constexpr):
    """An FP8 cache's scales of the keys and values at (block_id, slot) of one KV head, any shape (0 where key_mask
    is false, so that those keys weigh nothing); 1.0 for another cache. With per-tensor scales (KV_FP8 2) 1.0 where
    key_mask holds, 0 elsewhere: the tensor's own scales go on the scores and the output (_tensor_scales), and the
    tile steps that weigh keys by their scales (_attend_tile_keys_first, _attend_slices) run unchanged; _attend_tile
    does not read them."""
    if KV_FP8 == 2:
        k_scale = tl.where(key_mask, 1.0, 0.0)
        v_scale = k_scale
    elif KV_FP8:
        scale_rows = block_id * stride_scale_block + slot * stride_scale_slot + kv_head * stride_scale_head
        k_scale = tl.load(k_scale_ptr + scale_rows, mask=key_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_rows, mask=key_mask, other=0.0)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def _tensor_scales(k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr):
    """An FP8 cache's per-tensor scales (KV_FP8 2): the keys', which multiplies qk_scale, and the values', which
    multiplies the attention's output; 1.0 and 1.0 for any other cache."""
    if KV_FP8 == 2:
        k_tensor = tl.load(k_scale_ptr)
        v_tensor = tl.load(v_scale_ptr)
    else:
        k_tensor = 1.0
        v_tensor = 1.0
    return k_tensor, v_tensor


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
    key) applied to the scores and to the probabilities that weigh the values; per-tensor scales (KV_FP8 2) are
    applied by the kernel, not here.

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
    if KV_FP8 == 1:
        scores = scores * k_scale[None, :]
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    if KV_FP8 == 1 and KEYS_ACROSS_WARPS:
        tile_max, top = tl.reduce((scores, tl.broadcast_to(v_scale[None, :], scores.shape)), 1, _max_pair)
    else:
        tile_max = tl.max(scores, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_FP8 == 1 and KEYS_ACROSS_WARPS:  # top per row, all rows alike
        top = tl.where(top > 0.0, top, 1.0)
        weights = (p * v_scale[None, :] * (1.0 / top)[:, None]).to(v.dtype)
        acc = tl.dot(weights, v, acc=acc * (alpha / top)[:, None], input_precision=DOT_PRECISION) * top[:, None]
    elif KV_FP8 == 1:
        top = tl.max(v_scale, axis=0)
        top = tl.where(top > 0.0, top, 1.0)
        weights = (p * (v_scale / top)[None, :]).to(v.dtype)
        acc = tl.dot(weights, v, acc=acc * (alpha / top)[:, None], input_precision=DOT_PRECISION) * top
    else:
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_keys_first(q, k, v, k_scale, v_scale, key_mask, m_i, l_i, acc_t, qk_scale,
                            DOT_PRECISION: tl.constexpr, FP8_DOT: tl.constexpr, KV_FP8: tl.constexpr = 1):
    """_attend_tile on an FP8 cache with its values by slots, transposed: keys [N, D] and the values' transpose
    [D, N] are the products' first operands, whose rows the tensor cores take 16 (64 for the warpgroup MMA) at a
    time, the GQA group's queries [G, D] and probabilities [G, N] the second, whose G needs padding to 8 only, not
    16. Scores are [N, G], the accumulator acc_t [D, G]; qk_scale [1, G] or a scalar. With FP8_DOT the FP8 tiles
    are multiplied as stored (the queries in FP8, the probabilities rounded to FP8 over [0, _WEIGHT_SPAN]);
    otherwise widened to q's dtype, as _attend_tile does. With per-tensor scales (KV_FP8 2) and widened tiles no key
    has a scale of its own: the probabilities weigh the values as they are (the same sums as weighing them by 1.0)."""
    if not FP8_DOT:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    if KV_FP8 == 2 and not FP8_DOT:  # no scale a key
        scores = tl.where(key_mask[:, None], scores, float("-inf"))
        tile_max = tl.max(scores, axis=0)
    else:  # the scores' and the value scales' maxima in one reduction (one exchange between warps, not two)
        scores = tl.where(key_mask[:, None], scores * k_scale[:, None], float("-inf"))
        tile_max, top = tl.reduce((scores, tl.broadcast_to(v_scale[:, None], scores.shape)), 0, _max_pair)
    m_new = tl.maximum(m_i, tile_max)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_ref[None, :])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if KV_FP8 == 2 and not FP8_DOT:
        acc_t = tl.dot(tl.trans(v), p.to(v.dtype), acc=acc_t * alpha[None, :], input_precision=DOT_PRECISION)
    else:
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
    k_scale, v_scale = _load_kv_scales(k_scale_ptr, v_scale_ptr, block_id, slot, kv_head, key_mask,
                                       stride_scale_block, stride_scale_slot, stride_scale_head, KV_FP8)
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
