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
def _split_sum(partial_ptr, row, part, SPLITS, RANK, R_ALL, BLOCK_S: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """One projection's shrunk vector of a row [BLOCK_RANK]: its partial sums over the input's chunks, added."""
    splits = tl.arange(0, BLOCK_S)
    ranks = tl.arange(0, BLOCK_RANK)
    partial = tl.load(partial_ptr + (row * SPLITS + splits[:, None]) * R_ALL + part * RANK + ranks[None, :],
                      mask=(splits[:, None] < SPLITS) & (ranks[None, :] < RANK), other=0.0)
    return tl.sum(partial, axis=0)


@triton.jit
def _expand_kernel(partial_ptr, b_ptr, slot_ptr, out_ptr, N, RANK, R_ALL, SPLITS, END_0, END_1, stride_b_slot,
                   stride_b_row, stride_out, PARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RANK: tl.constexpr,
                   BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = 0):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_RANK)
        rank_mask = ranks < RANK
        # The projection each output column belongs to (a fused layer's slices end at END_0, END_1, then N).
        part = (cols >= END_0).to(tl.int32) + (cols >= END_1).to(tl.int32)
        first = _split_sum(partial_ptr, row, 0, SPLITS, RANK, R_ALL, BLOCK_S, BLOCK_RANK)
        shrunk = tl.zeros([BLOCK_N, BLOCK_RANK], tl.float32) + first[None, :]
        if PARTS > 1:
            second = _split_sum(partial_ptr, row, 1, SPLITS, RANK, R_ALL, BLOCK_S, BLOCK_RANK)
            shrunk = tl.where(part[:, None] == 1, second[None, :], shrunk)
        if PARTS > 2:
            third = _split_sum(partial_ptr, row, 2, SPLITS, RANK, R_ALL, BLOCK_S, BLOCK_RANK)
            shrunk = tl.where(part[:, None] == 2, third[None, :], shrunk)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_b_slot + cols[:, None].to(tl.int64) * stride_b_row
                    + ranks[None, :], mask=(cols[:, None] < N) & rank_mask[None, :], other=0.0)
        delta = tl.sum(shrunk * b.to(tl.float32), axis=1)
        out = out_ptr + row.to(tl.int64) * stride_out + cols
        current = tl.load(out, mask=cols < N, other=0.0)
        tl.store(out, (current.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=cols < N)


def add_lora_rows(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  slice_sizes: list[int], row_slots: torch.Tensor, pdl: int = 0) -> torch.Tensor:
    """add_lora for rows that each name their slot: row_slots [T] int (-1: no adapter), on x's device. out [T, N]
    gains each row's product in place (rounded once to out's dtype) and is returned. pdl: the launches' trigger
    mode (kernels/pdl.py; each program waits first, whatever its row's slot, which keeps the chain's order)."""
    if len(slice_sizes) > 3:
        raise ValueError(f"add_lora_rows takes at most 3 fused projections, got {len(slice_sizes)}")
    rows, K = x.shape
    N = out.shape[1]
    rank = lora_b.shape[-1]
    r_all = lora_a.shape[1]
    if r_all != len(slice_sizes) * rank or sum(slice_sizes) != N:
        raise ValueError(f"lora_a of {r_all} ranks and slices {slice_sizes} do not fit a rank of {rank} and an "
                         f"output of {N}")
    if not rows:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    splits = triton.cdiv(K, SPLIT_K)
    partial = torch.empty(rows, splits, r_all, dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(r_all))
    _shrink_kernel[(rows, triton.cdiv(r_all, block_r), splits)](
        x, lora_a, row_slots, partial, K, r_all, splits, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        BLOCK_R=block_r, BLOCK_K=min(_BLOCK_K, SPLIT_K), SPLIT=SPLIT_K, **launch_options(pdl))
    ends = [sum(slice_sizes[: index + 1]) for index in range(len(slice_sizes))]
    end_0 = ends[0] if len(ends) > 1 else N
    end_1 = ends[1] if len(ends) > 2 else N
    _expand_kernel[(rows, triton.cdiv(N, _BLOCK_N))](
        partial, lora_b, row_slots, out, N, rank, r_all, splits, end_0, end_1, lora_b.stride(0), lora_b.stride(1),
        out.stride(0), PARTS=len(slice_sizes), BLOCK_N=_BLOCK_N, BLOCK_RANK=triton.next_power_of_2(rank),
        BLOCK_S=triton.next_power_of_2(splits), **launch_options(pdl))
    return out
