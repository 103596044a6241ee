"""The tensor-parallel all-reduce of a row-parallel layer's output fused with the residual add and RMSNorm that
follow it, for decode-sized inputs on GPUs that map each other's memory (NVLink, symmetric memory).

At tensor-parallel size 2, a batch-1 decode step of Llama-3.1-8B runs 64 all-reduces (after each o and down
projection), each a separate kernel between the projection and an RMSNorm kernel: ~8 us for the all-reduce plus
the RMSNorm and two kernel boundaries, 64 times a step. Here one kernel does all three. Each program owns one
row (token): it

1. stores its rank's partial row into slot (parity, this rank, row) of every rank's exchange buffer (remote
   stores over NVLink; the buffer and the flags are symmetric allocations, one per rank, mapped by all);
2. raises the flag of that slot on every other rank (a release at system scope, after a barrier of the
   program's threads, so the row's stores are visible before the flag);
3. waits until every other rank has raised its flag for (parity, that rank, row) here, and lowers it (an
   acquire);
4. adds the rows in rank order (float32, then rounded to the input dtype: every rank computes the same bits),
   adds the residual and normalises, as kernels/triton_ops.fused_add_rms_norm does.

Consecutive calls use the two halves of the buffers in turn (the parity, from a call counter each rank keeps
on its device and the last program of a call advances). A rank writes a half again only two calls later, after
every rank has raised its flags for the call in between, which each raises only once it has finished reading
the call before: so no row is overwritten while it is read, with one flag exchange per call. The counter lives
on the device so that CUDA graph replays and eager calls share one sequence; every rank makes the same calls in
the same order (tensor-parallel ranks run the same model), so the parities agree.

A program waits a few minutes at most for a flag, then traps: a rank that died shows as a CUDA error rather
than as GPUs spinning forever.

On by default for tensor parallelism on CUDA; kernel_config.fused_allreduce_norm=false turns it off
(actors/symmetric_memory.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.pdl import launch_options, pdl_wait

# How long a program waits for a flag before it traps (the GPU's global timer, in ns): longer than any rank lags
# another while it compiles or tunes kernels at start-up on a cold cache. (A count of polls measured ~100 s on
# the H200, less than a cold start may need.)
_TIMEOUT_NS = tl.constexpr(300 * 10**9)


@triton.jit
def _global_time_ns(dependency):
    """The GPU's global timer (ns), read after `dependency` is computed."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dependency], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["rows"])
def _all_reduce_add_rms_norm_kernel(
    partial_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, buffers_ptr, flags_ptr, state_ptr, rows,
    hidden_size, eps, stride_partial, stride_residual, stride_out, stride_residual_out,
    RANK: tl.constexpr, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    """buffers_ptr / flags_ptr: each rank's exchange buffer [2, WORLD, MAX_ROWS, hidden_size] (the partials'
    dtype) and flags [2, WORLD, MAX_ROWS] (int32), as device addresses (int64 [WORLD]); state_ptr: this
    rank's int32 [call count, arrivals]. One program a row."""
    row = tl.program_id(0)
    pdl_wait(USE_PDL)
    calls = tl.load(state_ptr)
    parity = calls % 2
    # The last program to have read the count advances it (the next call reads it after this kernel ends).
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu") == rows - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, calls + 1)

    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = partial_ptr.dtype.element_ty
    mine = tl.load(partial_ptr + row * stride_partial + cols, mask=mask, other=0.0)
    slot = (parity * WORLD + RANK) * MAX_ROWS + row
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            buffer = tl.multiple_of(tl.load(buffers_ptr + peer).to(tl.pointer_type(dtype)), 16)
            tl.store(buffer + slot * hidden_size + cols, mine, mask=mask)
    tl.debug_barrier()  # every thread's stores are issued before the flags go up
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flags = tl.load(flags_ptr + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + slot, 1, sem="release", scope="sys")
    own_flags = tl.load(flags_ptr + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = own_flags + (parity * WORLD + peer) * MAX_ROWS + row
            raised = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
            waiting_since = tl.zeros([], dtype=tl.int64)
            while raised != 1:
                raised = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
                now = _global_time_ns(raised)
                waiting_since = tl.where(waiting_since == 0, now, waiting_since)
                if now - waiting_since > _TIMEOUT_NS:  # a rank that never comes (it died): an error, not a GPU
                    # spinning forever
                    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r,r", [raised], dtype=tl.int32,
                                              is_pure=False, pack=1)
    tl.debug_barrier()

    own_buffer = tl.multiple_of(tl.load(buffers_ptr + RANK).to(tl.pointer_type(dtype)), 16)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for source in tl.static_range(WORLD):
        if source == RANK:
            total += mine.to(tl.float32)
        else:
            offset = ((parity * WORLD + source) * MAX_ROWS + row) * hidden_size
            total += tl.load(own_buffer + offset + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
    x = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, axis=0) / hidden_size
    normed = (hidden * tl.rsqrt(variance + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def all_reduce_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                            buffers: torch.Tensor, flags: torch.Tensor, state: torch.Tensor, rank: int,
                            max_rows: int, pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(sum over ranks of partial + residual), that sum + residual) for partial, residual [rows,
    hidden] (rows <= max_rows): every rank of the group calls it with its own partial, at the same point of
    the same sequence of calls. buffers / flags: int64 [world] device addresses of each rank's exchange buffer
    and flags (the module's docstring); state: this rank's int32 [2], zero before the first call. `pdl`: the
    launch's trigger mode (kernels/pdl.py)."""
    rows, hidden_size = partial.shape
    if residual.shape != partial.shape or residual.dtype != partial.dtype:
        raise ValueError(f"residual must match partial ({list(partial.shape)}, {partial.dtype}), got "
                         f"{list(residual.shape)}, {residual.dtype}")
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must be [{hidden_size}], got {list(weight.shape)}")
    if not 0 < rows <= max_rows:
        raise ValueError(f"partial must have 1 to {max_rows} rows, got {rows}")
    if partial.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("partial and residual need contiguous rows")
    world = buffers.numel()
    out = torch.empty(partial.shape, dtype=torch.promote_types(partial.dtype, weight.dtype), device=partial.device)
    residual_out = torch.empty_like(partial, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(hidden_size)
    _all_reduce_add_rms_norm_kernel[(rows,)](
        partial, residual, weight.contiguous(), out, residual_out, buffers, flags, state, rows, hidden_size, eps,
        partial.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        RANK=rank, WORLD=world, MAX_ROWS=max_rows, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        **launch_options(pdl),
    )
    return out, residual_out
