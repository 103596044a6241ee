"""Chunked prefill attention in Triton: causal attention of chunks of new query tokens over their paged contexts,
the chunk's own keys included, built from attention_tiles.py's tile steps (the cache layouts, the FP8 cache and the
online softmax are described there)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from raylm.kernels.attention_tiles import (
    _LOG2_E,
    TileConfig,
    _attend_tile,
    _dot_precision,
    _fp8_cache_queries,
    _load_kv_tile,
    _tensor_scales,
    _window,
)
from raylm.kernels.triton_kv_cache import cache_scales, check_cache, check_value_cache, value_strides


def prefill_config(head_dim: int, element_size: int) -> TileConfig:
    """Prefill tiles: block_m rows are query tokens times the (padded) GQA group.

    Chosen by a sweep on an H200 (bf16, page 16): about 300-350 TFLOP/s for thousands of tokens (d128).
    Float32 tiles hold half the keys, so that Q and the K/V stages fit in shared memory.
    """
    shrink = 2 if element_size > 2 else 1
    if head_dim <= 64:
        return TileConfig(block_m=128, block_n=64 // shrink, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return TileConfig(block_m=128, block_n=128 // shrink, num_warps=8, num_stages=2)
    return TileConfig(block_m=64, block_n=32 // shrink, num_warps=4, num_stages=2)


@triton.jit
def _prefill_tile(q, k_cache_ptr, v_cache_ptr, table_row, tile_start, key_end, query_pos, window, kv_head, dims,
                  dim_mask, m_i, l_i, acc, qk_scale, stride_block, stride_slot, stride_head, stride_v_block,
                  stride_v_slot, stride_v_head, stride_v_dim, k_scale_ptr, v_scale_ptr, stride_scale_block,
                  stride_scale_slot, stride_scale_head, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, V_BY_SLOTS: tl.constexpr,
                  V_RUN: tl.constexpr):
    """Attends a prefill tile's rows to the keys tile_start.. (causally and within the window if MASKED); values
    by slots in whole runs of V_RUN keys (tile_start a multiple of V_RUN)."""
    key_pos = tile_start + tl.arange(0, BLOCK_N)
    key_mask = key_pos < key_end
    k, v, k_scale, v_scale = _load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, key_pos, key_mask, kv_head, dims,
                                           dim_mask, stride_block, stride_slot, stride_head, stride_v_block,
                                           stride_v_slot, stride_v_head, stride_v_dim, k_scale_ptr, v_scale_ptr,
                                           stride_scale_block, stride_scale_slot, stride_scale_head, PAGE_SIZE,
                                           KV_FP8, V_BY_SLOTS, V_RUN, key_end)
    visible = ((key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
               & key_mask[None, :])
    return _attend_tile(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, qk_scale, MASKED, DOT_PRECISION, KV_FP8)


@triton.jit(do_not_specialize=["num_seqs", "stride_table"])  # see _decode_split_kernel
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_starts_ptr,
    context_lens_ptr, qk_scale, window, num_seqs, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_block, stride_slot, stride_head, stride_table,
    stride_v_block, stride_v_slot, stride_v_head, stride_v_dim,
    k_scale_ptr, v_scale_ptr, stride_scale_block, stride_scale_slot, stride_scale_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, SEQ_CHUNK: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False, V_BY_SLOTS: tl.constexpr = False,
    V_RUN: tl.constexpr = 16,
):
    """One tile of BLOCK_M // GROUP_PAD query tokens of one sequence, all query heads of one KV head.

    Sequence s owns the tiles from query_start_loc[s] // BLOCK_Q + s on: that start is strictly increasing
    in s and leaves each sequence at least cdiv(query_len, BLOCK_Q) tiles, so the grid needs no host-side
    prefix sums; a program finds its sequence by counting the starts at or below its tile id.
    """
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    started = tl.zeros([SEQ_CHUNK], tl.int32)
    for chunk in range(0, num_seqs, SEQ_CHUNK):
        seqs = chunk + tl.arange(0, SEQ_CHUNK)
        starts = tl.load(query_start_loc_ptr + seqs, mask=seqs < num_seqs, other=0) // BLOCK_Q + seqs
        started += ((starts <= tile_id) & (seqs < num_seqs)).to(tl.int32)
    seq = tl.sum(started, axis=0) - 1
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    first_query = (tile_id - query_start // BLOCK_Q - seq) * BLOCK_Q
    if first_query >= query_len:
        return
    seq_start = tl.load(seq_starts_ptr + seq)
    context_len = tl.load(context_lens_ptr + seq)

    # Row r of the tile is query token first_query + r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_M)
    tokens = first_query + rows // GROUP_PAD
    groups = rows % GROUP_PAD
    heads = kv_head * GROUP + groups
    row_mask = (tokens < query_len) & (groups < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    query_pos = seq_start + tokens
    token_rows = (query_start + tokens).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    q = _fp8_cache_queries(q, KV_FP8)
    k_tensor, v_tensor = _tensor_scales(k_scale_ptr, v_scale_ptr, KV_FP8)  # an FP8 cache's per-tensor scales
    qk_scale = qk_scale * k_tensor

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    key_end = tl.minimum(seq_start + first_query + BLOCK_Q, context_len)
    key_begin = tl.maximum(seq_start + first_query - window + 1, 0)
    if V_BY_SLOTS:  # tiles from a run's start (the window's mask hides the keys before key_begin)
        key_begin = key_begin // V_RUN * V_RUN
    # Without a window, whole tiles of keys before the tile's first query are visible to every row: they
    # skip the mask. The rest (the diagonal, and every tile when a window may cut rows) is masked.
    unmasked_end = key_begin
    if not HAS_WINDOW:
        unmasked_end += (seq_start + first_query - key_begin) // BLOCK_N * BLOCK_N
    for tile_start in range(key_begin, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, k_cache_ptr, v_cache_ptr, table_row, tile_start, key_end, query_pos,
                                      window, kv_head, dims, dim_mask, m_i, l_i, acc, qk_scale, stride_block,
                                      stride_slot, stride_head, stride_v_block, stride_v_slot, stride_v_head,
                                      stride_v_dim, k_scale_ptr, v_scale_ptr, stride_scale_block,
                                      stride_scale_slot, stride_scale_head, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION,
                                      KV_FP8,
                                      V_BY_SLOTS, V_RUN)
    for tile_start in range(unmasked_end, key_end, BLOCK_N):
        m_i, l_i, acc = _prefill_tile(q, k_cache_ptr, v_cache_ptr, table_row, tile_start, key_end, query_pos,
                                      window, kv_head, dims, dim_mask, m_i, l_i, acc, qk_scale, stride_block,
                                      stride_slot, stride_head, stride_v_block, stride_v_slot, stride_v_head,
                                      stride_v_dim, k_scale_ptr, v_scale_ptr, stride_scale_block,
                                      stride_scale_slot, stride_scale_head, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION,
                                      KV_FP8,
                                      V_BY_SLOTS, V_RUN)

    if KV_FP8 == 2:
        acc = acc * v_tensor
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: tuple[torch.Tensor, ...] = (),
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Causal attention of S chunks of new query tokens over their paged contexts; returns [T, H_q, D].

    q: [T, H_q, D], the chunks concatenated; query_start_loc: [S + 1] int32 offsets of each chunk in q;
    seq_starts: [S] int32 position of each chunk's first token (keys already cached before it);
    context_lens: [S] int32 = seq_starts + query lengths. Every key, the chunk's own included, is read from
    the cache through block_tables [S, max_blocks] int32. The query at position p sees keys 0..p, and with a
    sliding window only those > p - sliding_window. kv_scales: an FP8 cache's (k_scale, v_scale). config: tiles
    instead of prefill_config's (for benchmarks; block_m is raised to the GQA group's power of two).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_cache("k_cache", k_cache, num_kv_heads, head_dim)
    check_value_cache(v_cache, k_cache)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of the cache's KV heads ({num_kv_heads})")
    num_seqs = seq_starts.shape[0]
    if (query_start_loc.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,)
            or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs):
        raise ValueError(f"for {num_seqs} sequences query_start_loc must be [{num_seqs + 1}], context_lens "
                         f"[{num_seqs}] and block_tables [{num_seqs}, max_blocks]; got "
                         f"{list(query_start_loc.shape)}, {list(context_lens.shape)}, {list(block_tables.shape)}")
    if q.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q and block_tables must be contiguous in their last dimension")
    k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head, fp8 = cache_scales(k_cache, kv_scales)
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    config = config or prefill_config(block_d, q.element_size())
    block_m = max(config.block_m, group_pad)
    grid = (num_tokens // (block_m // group_pad) + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_starts, context_lens,
        scale * _LOG2_E, _window(sliding_window), num_seqs, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *value_strides(v_cache),
        k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1], SEQ_CHUNK=128, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype), KV_FP8=fp8, V_BY_SLOTS=v_cache.stride() != k_cache.stride(),
        V_RUN=math.gcd(k_cache.shape[1], config.block_n, 16), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
