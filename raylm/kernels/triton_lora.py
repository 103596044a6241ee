"""The batched LoRA product in two Triton kernels, for decode-sized steps where every row may carry its own
adapter: shrink (each row's input times its slot's A, in partial sums over chunks of the input: [T, splits,
slices * rank], float32) and expand (the partial sums added up, times the slot's B, added to the layer's output in
place). The programs each read their row's slot from a tensor, so the launch has the same shape whatever the rows'
adapters are (what a CUDA graph needs); a row of slot -1 (the base model) adds nothing.

Shrink splits the input into SPLIT_K-wide chunks, a program each: a decode step has a few rows, and one program per
row walking a 14,336-wide input waits on each of its loads in turn (8 rows of an 8B model's layers took ~80 us a
layer on the H200). The chunks are fixed by the input's width alone and summed in a fixed order, so a row's
product does not depend on the batch it is in. kernels/lora.py's add_lora (rows grouped by slot, in torch) is the
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from raylm.kernels.pdl import launch_options, pdl_wait

_BLOCK_K = 128
_BLOCK_N = 128
# The input columns one shrink program sums (a multiple of _BLOCK_K).
SPLIT_K = 256


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, K, R_ALL, SPLITS, stride_x, stride_a_slot, stride_a_row,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + row)
    acc = tl.zeros([BLOCK_R], tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks[:, None].to(tl.int64) * stride_a_row
        for offset in range(0, SPLIT, BLOCK_K):
            ks = split * SPLIT + offset + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row.to(tl.int64) * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
            a = tl.load(a_rows + ks[None, :], mask=(ranks[:, None] < R_ALL) & (ks[None, :] < K), other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + (row * SPLITS + split) * R_ALL + ranks, acc, mask=ranks < R_ALL)


@triton.jit
def _split_sum(partial_ptr, row, part, SPLITS, RANK, R_ALL, BLOCK_S: tl.constexpr, BLOCK_RANK: tl.constexpr,
               READ_SPLITS):
    """One projection's shrunk vector of a row [BLOCK_RANK]: its partial sums over the input's chunks (the first
    READ_SPLITS of the SPLITS there are: all of them, or none to read nothing and get zeros), added."""
    splits = tl.arange(0, BLOCK_S)
    ranks = tl.arange(0, BLOCK_RANK)
    partial = tl.load(partial_ptr + (row * SPLITS + splits[:, None]) * R_ALL + part * RANK + ranks[None, :],
                      mask=(splits[:, None] < READ_SPLITS) & (ranks[None, :] < RANK), other=0.0)
    return tl.sum(partial, axis=0)


@triton.jit
def _row_product(partial_ptr, b_ptr, row, slot, cols, col_mask, SPLITS, RANK, R_ALL, END_0, END_1, stride_b_slot,
                 stride_b_row, PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RANK: tl.constexpr,
                 BLOCK_S: tl.constexpr, READ_SPLITS):
    """One row's adapter product at output features `cols` [BLOCK_N], float32: its shrink's partial sums added in
    split order (for the projection each column belongs to: a fused layer's slices end at END_0, END_1, then N),
    times its slot's B; zeros, reading no partial sums and no B, for READ_SPLITS 0 and a col_mask all false."""
    ranks = tl.arange(0, BLOCK_RANK)
    part = (cols >= END_0).to(tl.int32) + (cols >= END_1).to(tl.int32)
    first = _split_sum(partial_ptr, row, 0, SPLITS, RANK, R_ALL, BLOCK_S, BLOCK_RANK, READ_SPLITS)
    shrunk = tl.zeros([BLOCK_N, BLOCK_RANK], tl.float32) + first[None, :]
    if PARTS > 1:
        second = _split_sum(partial_ptr, row, 1, SPLITS, RANK, R_ALL, BLOCK_S, BLOCK_RANK, READ_SPLITS)
        shrunk = tl.where(part[:, None] == 1, second[None, :], shrunk)
    if PARTS > 2:
        third = _split_sum(partial_ptr, row, 2, SPLITS, RANK, R_ALL, BLOCK_S, BLOCK_RANK, READ_SPLITS)
        shrunk = tl.where(part[:, None] == 2, third[None, :], shrunk)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + cols[:, None].to(tl.int64) * stride_b_row
                + ranks[None, :], mask=col_mask[:, None] & (ranks < RANK)[None, :], other=0.0)
    return tl.sum(shrunk * b.to(tl.float32), axis=1)


@triton.jit
def _expand_kernel(partial_ptr, b_ptr, slot_ptr, out_ptr, N, SPLITS, RANK, R_ALL, END_0, END_1, stride_b_slot,
                   stride_b_row, stride_out, PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RANK: tl.constexpr,
                   BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = 0, STORE: tl.constexpr = 0):
    """out[row] += the row's product; with STORE, out[row] = it (zeros for a row without an adapter), not read."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + row)
    if STORE:
        active = tl.where(slot >= 0, 1, 0)
        delta = _row_product(partial_ptr, b_ptr, row, tl.maximum(slot, 0), cols, (cols < N) & ((cols * 0 + active) > 0),
                             SPLITS, RANK, R_ALL, END_0, END_1, stride_b_slot, stride_b_row, PARTS, BLOCK_N, BLOCK_RANK,
                             BLOCK_S, SPLITS * active)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, delta.to(out_ptr.dtype.element_ty), mask=cols < N)
    elif slot >= 0:
        delta = _row_product(partial_ptr, b_ptr, row, slot, cols, cols < N, SPLITS, RANK, R_ALL, END_0, END_1,
                             stride_b_slot, stride_b_row, PARTS, BLOCK_N, BLOCK_RANK, BLOCK_S, SPLITS)
        out = out_ptr + row.to(tl.int64) * stride_out + cols
        current = tl.load(out, mask=cols < N, other=0.0)
        tl.store(out, (current.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=cols < N)


def _slice_ends(slice_sizes: list[int]) -> tuple[int, int]:
    """Where a fused layer's first two slices end (the whole width where it has fewer): the kernels' END_0, END_1."""
    n = sum(slice_sizes)
    ends = [sum(slice_sizes[: index + 1]) for index in range(len(slice_sizes))]
    return ends[0] if len(ends) > 1 else n, ends[1] if len(ends) > 2 else n


@dataclass
class LoraRows:
    """A step's shrunk rows of one adapted layer (lora_shrink), ready for the expand: lora_expand into the layer's
    output, or lora_products into a buffer of their own."""

    partial: torch.Tensor  # [rows, splits, slices * rank] float32
    lora_b: torch.Tensor  # [slots, N, rank]
    row_slots: torch.Tensor  # [rows] int32, -1: no adapter
    slice_sizes: list[int]

    def kernel_args(self) -> tuple:
        """The expand's runtime arguments after the partial sums, B and the slots: splits, rank, slices * rank, the
        first two slices' ends (N where there are fewer), B's strides."""
        splits, r_all = self.partial.shape[1], self.partial.shape[2]
        return (splits, self.lora_b.shape[-1], r_all, *_slice_ends(self.slice_sizes), self.lora_b.stride(0),
                self.lora_b.stride(1))

    def kernel_flags(self) -> dict:
        return {"PARTS": len(self.slice_sizes), "BLOCK_RANK": triton.next_power_of_2(self.lora_b.shape[-1]),
                "BLOCK_S": triton.next_power_of_2(self.partial.shape[1])}


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int],
                row_slots: torch.Tensor, pdl: int = 0) -> LoraRows:
    """The shrink of add_lora_rows: each row's input times its slot's A, in partial sums over the input's chunks."""
    if len(slice_sizes) > 3:
        raise ValueError(f"a LoRA product takes at most 3 fused projections, got {len(slice_sizes)}")
    rows, K = x.shape
    rank = lora_b.shape[-1]
    r_all = lora_a.shape[1]
    if r_all != len(slice_sizes) * rank or sum(slice_sizes) != lora_b.shape[1]:
        raise ValueError(f"lora_a of {r_all} ranks and slices {slice_sizes} do not fit a rank of {rank} and an "
                         f"output of {lora_b.shape[1]}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    splits = triton.cdiv(K, SPLIT_K)
    partial = torch.empty(rows, splits, r_all, dtype=torch.float32, device=x.device)
    if rows:
        block_r = min(64, triton.next_power_of_2(r_all))
        _shrink_kernel[(rows, triton.cdiv(r_all, block_r), splits)](
            x, lora_a, row_slots, partial, K, r_all, splits, x.stride(0), lora_a.stride(0), lora_a.stride(1),
            BLOCK_R=block_r, BLOCK_K=min(_BLOCK_K, SPLIT_K), SPLIT=SPLIT_K, **launch_options(pdl))
    return LoraRows(partial, lora_b, row_slots, slice_sizes)


def lora_expand(out: torch.Tensor, lora: LoraRows, pdl: int = 0) -> torch.Tensor:
    """out [T, N] gains each row's product (lora_shrink's rows) in place, rounded once to out's dtype."""
    rows, N = out.shape
    if N != lora.lora_b.shape[1]:
        raise ValueError(f"an output of {N} features does not fit adapters of {lora.lora_b.shape[1]}")
    if rows:
        _expand_kernel[(rows, triton.cdiv(N, _BLOCK_N))](
            lora.partial, lora.lora_b, lora.row_slots, out, N, *lora.kernel_args(), out.stride(0), BLOCK_N=_BLOCK_N,
            **lora.kernel_flags(), **launch_options(pdl))
    return out


def lora_products(lora: LoraRows, pdl: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's product (zeros for a row without an adapter) into a float32 buffer of its own (`out` [rows, N]
    where given), returned: the expand needs only the shrink, not the layer's output, so it can run beside the
    layer's GEMV on another stream (kernel_config.lora_expand 'beside', models/lora.py)."""
    rows, N = lora.partial.shape[0], lora.lora_b.shape[1]
    products = out if out is not None else torch.empty(rows, N, dtype=torch.float32, device=lora.partial.device)
    if products.shape != (rows, N) or products.dtype != torch.float32 or not products.is_contiguous():
        raise ValueError(f"LoRA products go to a contiguous float32 [{rows}, {N}] buffer, got {products.dtype} "
                         f"{list(products.shape)}")
    if rows:
        _expand_kernel[(rows, triton.cdiv(N, _BLOCK_N))](
            lora.partial, lora.lora_b, lora.row_slots, products, N, *lora.kernel_args(), products.stride(0),
            BLOCK_N=_BLOCK_N, **lora.kernel_flags(), **launch_options(pdl), STORE=1)
    return products


def add_lora_rows(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  slice_sizes: list[int], row_slots: torch.Tensor, pdl: int = 0) -> torch.Tensor:
    """add_lora for rows that each name their slot: row_slots [T] int (-1: no adapter), on x's device. out [T, N]
    gains each row's product in place (rounded once to out's dtype) and is returned. pdl: the launches' trigger
    mode (kernels/pdl.py; each program waits first, whatever its row's slot, which keeps the chain's order)."""
    if out.shape[1] != sum(slice_sizes):
        raise ValueError(f"slices {slice_sizes} do not fit an output of {out.shape[1]}")
    return lora_expand(out, lora_shrink(x, lora_a, lora_b, slice_sizes, row_slots, pdl), pdl)


# Steps of more rows than decode's (a prompt's prefill, chunked or not) run each linear layer's adapters in two
# launches over segments: runs of consecutive rows of one slot (a request's tokens), cut into blocks of
# SEGMENT_ROWS rows whose products go through the tensor cores together. Grouping rows by slot in torch instead
# (add_lora) takes about five launches a slot and layer, which left the prefill of 8 requests with 8 adapters
# bound by its launches on the host (~150 ms for 8 x 32 tokens of an 8B model).
SEGMENT_ROWS = 32
# The ranks of all a layer's slices (slices * rank) that the segment expand holds in one tile; wider layers group
# their rows by slot in torch.
SEGMENT_MAX_RANKS = 256
# The segment shrink's programs a launch aims at: its input chunks are 256 wide (SPLIT_K) for a step of few blocks,
# and wider (by powers of two) where the blocks alone keep the GPU busy, so that the expand, which sums a block's
# chunks once per program, reads fewer of them.
SEGMENT_PROGRAMS = 512
# Output tiles one segment-expand program covers, after summing its rows' shrunk vectors once.
_SEGMENT_N_TILES = 4
_SEGMENT_BLOCK_N = 64
_SEGMENT_BLOCK_K = 64


def segment_blocks(row_slots, block_rows: int = SEGMENT_ROWS):
    """The blocks of a step's rows for the segment kernels, as an int32 array [blocks, 3] of (first row, rows,
    slot): each run of consecutive rows with the same adapter slot (>= 0) cut into blocks of at most block_rows."""
    slots = np.asarray(row_slots, dtype=np.int64)
    if slots.size == 0:
        return np.zeros((0, 3), dtype=np.int32)
    starts = np.flatnonzero(np.concatenate(([True], slots[1:] != slots[:-1])))
    ends = np.append(starts[1:], slots.size)
    blocks = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        slot = int(slots[start])
        if slot >= 0:
            blocks.extend((first, min(block_rows, end - first), slot) for first in range(start, end, block_rows))
    return np.asarray(blocks, dtype=np.int32).reshape(-1, 3)


@triton.jit
def _segment_rows(blocks_ptr, block, BLOCK_M: tl.constexpr):
    """A segment block's rows (int64, [BLOCK_M]), which of them it holds, and its slot."""
    first = tl.load(blocks_ptr + block * 3)
    count = tl.load(blocks_ptr + block * 3 + 1)
    lines = tl.arange(0, BLOCK_M)
    return (first + lines).to(tl.int64), lines < count, tl.load(blocks_ptr + block * 3 + 2)


@triton.jit
def _segment_shrink_kernel(x_ptr, a_ptr, blocks_ptr, out_ptr, K, R_ALL, SPLITS, stride_x, stride_a_slot,
                           stride_a_row, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A block's rows times its slot's A over one SPLIT-wide chunk of the input: partial sums [rows, R] of its
    ranks' tile, stored at out[row, split]."""
    block = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(2)
    rows, row_mask, slot = _segment_rows(blocks_ptr, block, BLOCK_M)
    a_rows = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks[:, None].to(tl.int64) * stride_a_row
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for offset in range(0, SPLIT, BLOCK_K):
        ks = split * SPLIT + offset + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :],
                    other=0.0)
        a = tl.load(a_rows + ks[None, :], mask=(ranks < R_ALL)[:, None] & (ks < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(a), acc=acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + (rows[:, None] * SPLITS + split) * R_ALL + ranks[None, :], acc,
             mask=row_mask[:, None] & (ranks < R_ALL)[None, :])


@triton.jit
def _segment_expand_kernel(partial_ptr, b_ptr, blocks_ptr, out_ptr, N, SPLITS, RANK, R_ALL, END_0, END_1,
                           stride_b_slot, stride_b_row, stride_out, BLOCK_M: tl.constexpr, BLOCK_RALL: tl.constexpr,
                           BLOCK_N: tl.constexpr, N_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A block's rows gain their products over N_TILES output tiles: the shrunk vectors (partial sums added in
    split order) times the slot's B, held as a block-diagonal tile (rank k of the layer's slices multiplies only
    the columns of its own slice), in one dot a tile."""
    rows, row_mask, slot = _segment_rows(blocks_ptr, tl.program_id(0), BLOCK_M)
    ks = tl.arange(0, BLOCK_RALL)
    shrunk = tl.zeros([BLOCK_M, BLOCK_RALL], tl.float32)
    for split in range(0, SPLITS):
        shrunk += tl.load(partial_ptr + (rows[:, None] * SPLITS + split) * R_ALL + ks[None, :],
                          mask=row_mask[:, None] & (ks < R_ALL)[None, :], other=0.0)
    shrunk = shrunk.to(b_ptr.dtype.element_ty)
    k_part = ks // RANK
    b_slot = b_ptr + slot.to(tl.int64) * stride_b_slot + (ks - k_part * RANK)[:, None]
    for tile in range(N_TILES):
        cols = (tl.program_id(1) * N_TILES + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_part = (cols >= END_0).to(tl.int32) + (cols >= END_1).to(tl.int32)
        b = tl.load(b_slot + cols[None, :].to(tl.int64) * stride_b_row,
                    mask=(ks < R_ALL)[:, None] & (k_part[:, None] == col_part[None, :]) & (cols < N)[None, :],
                    other=0.0)
        delta = tl.dot(shrunk, b, input_precision=DOT_PRECISION)
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        mask = row_mask[:, None] & (cols < N)[None, :]
        current = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (current.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora_segments(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slice_sizes: list[int], blocks: torch.Tensor) -> torch.Tensor:
    """add_lora for a step's rows in segments (segment_blocks' blocks, int32 on x's device): out [T, N] gains each
    block's rows' products in place, rounded once to out's dtype, and is returned. Rows in no block add nothing."""
    rows, K = x.shape
    rank = lora_b.shape[-1]
    r_all = lora_a.shape[1]
    if r_all != len(slice_sizes) * rank or sum(slice_sizes) != lora_b.shape[1] or out.shape != (rows, lora_b.shape[1]):
        raise ValueError(f"lora_a of {r_all} ranks, slices {slice_sizes} and an output of {list(out.shape)} do not fit "
                         f"a rank of {rank} and adapters of {lora_b.shape[1]} features")
    if len(slice_sizes) > 3 or r_all > SEGMENT_MAX_RANKS:
        raise ValueError(f"the segment kernels take at most 3 slices and {SEGMENT_MAX_RANKS} ranks, got "
                         f"{len(slice_sizes)} slices of rank {rank}")
    count = blocks.shape[0]
    if not count:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    split = max(SPLIT_K, triton.next_power_of_2(triton.cdiv(K, triton.cdiv(SEGMENT_PROGRAMS, count))))
    splits = triton.cdiv(K, split)
    partial = torch.empty(rows, splits, r_all, dtype=torch.float32, device=x.device)
    block_r = min(64, max(16, triton.next_power_of_2(r_all)))
    _segment_shrink_kernel[(count, triton.cdiv(r_all, block_r), splits)](
        x, lora_a, blocks, partial, K, r_all, splits, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_M=SEGMENT_ROWS, BLOCK_R=block_r, BLOCK_K=_SEGMENT_BLOCK_K, SPLIT=split, DOT_PRECISION=precision)
    n = lora_b.shape[1]
    _segment_expand_kernel[(count, triton.cdiv(n, _SEGMENT_BLOCK_N * _SEGMENT_N_TILES))](
        partial, lora_b, blocks, out, n, splits, rank, r_all, *_slice_ends(slice_sizes), lora_b.stride(0),
        lora_b.stride(1), out.stride(0), BLOCK_M=SEGMENT_ROWS, BLOCK_RALL=max(16, triton.next_power_of_2(r_all)),
        BLOCK_N=_SEGMENT_BLOCK_N, N_TILES=_SEGMENT_N_TILES, DOT_PRECISION=precision)
    return out
