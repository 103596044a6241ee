"""Skinny matmul for decode: y = x W^T with few rows of x (batch ≤ GEMV_MAX_ROWS) and a half-precision W.

At batch 1–8 a decode step reads every weight once and does almost no arithmetic per byte, so a linear layer
is as fast as it streams W from memory. Each program owns BLOCK_N rows of W (output features) and walks K in
BLOCK_K tiles, K being W's contiguous dimension; the few rows of x (padded to 16 for the tensor-core dot)
come from L2. Accumulation is in float32, in a fixed order: results do not depend on timing (no split-K
atomics). Tile sizes are tuned per (N, K) at the first call, which is an eager warm-up before any CUDA graph
is captured.

Off unless RAYLM_TRITON_GEMV=1 (see dispatch.linear) until it is measured faster than cuBLAS on
the target GPU: `python benchmarks/gemv.py`. Under programmatic dependent launch (RAYLM_PDL=1, kernels/pdl.py)
a program loads its first weight tile before it waits for the kernel before it.

The small kernels before a decode GEMV (add + RMSNorm before qkv and gate_up, SiLU-mul before down) stay
separate: folding them into this kernel's input loads was measured 3-4x slower per call on the H200 (Triton
3.6: 51.6 us against 17.5 for norm + GEMV at qkv, 129.5 against 31.8 for SiLU-mul + down; docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from raylm.kernels.dispatch import GEMV_MAX_ROWS
from raylm.kernels.pdl import pdl_options, pdl_wait, prefetch_l2

_BLOCK_M = 16  # tl.dot's smallest tile; rows past M are masked


def _configs() -> list[triton.Config]:
    """Tile shapes to time per (N, K); Triton's timing clears the L2 between runs, as a real step finds it."""
    configs = [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=4, num_stages=stages)
               for block_n in (16, 32, 64) for block_k in (128, 256) for stages in (3, 4)]
    # Wider K tiles with more warps keep more bytes of W in flight per SM when there are few programs.
    configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": 512}, num_warps=8, num_stages=stages)
                for block_n in (16, 32) for stages in (2, 3)]
    return configs


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr = False, PREFETCH_TILES: tl.constexpr = 0, LINE: tl.constexpr = 64):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output features = rows of W
    row_mask = rows < M
    col_mask = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    # The first weight tile (and, with PREFETCH_TILES, the next ones into L2) is requested before pdl_wait:
    # weights are not written during a step, so under PDL they stream in while the kernel before finishes.
    ks = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < K)[None, :], other=0.0)
    if PREFETCH_TILES > 0:
        lines = BLOCK_K + tl.arange(0, PREFETCH_TILES * BLOCK_K // LINE) * LINE  # one element per LINE elements
        safe = col_mask[:, None] & (lines < K)[None, :]
        prefetch_l2(tl.where(safe, w_rows + lines[None, :], w_ptr))
    pdl_wait(USE_PDL)
    x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
    for start in range(BLOCK_K, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


_gemv_tuned = triton.autotune(configs=_configs(), key=["N", "K"])(_gemv_kernel)
# The interpreter (CPU tests; read at import, as Triton does) has no device to time configurations on: it runs one.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128}


def prefetch_tiles() -> int:
    """Weight tiles past the first that a GEMV launched with PDL pulls into L2 before it waits
    (RAYLM_GEMV_PREFETCH_TILES, default 0: to be chosen by measurement, `bash benchmarks/h200.sh pdl`)."""
    value = os.environ.get("RAYLM_GEMV_PREFETCH_TILES", "0")
    if value not in ("0", "1", "2", "4", "8", "16"):
        raise ValueError(f"RAYLM_GEMV_PREFETCH_TILES must be 0, 1, 2, 4, 8 or 16, got {value!r}")
    return int(value)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most GEMV_MAX_ROWS rows (any leading shape) and a half-precision
    weight [N, K] with contiguous rows."""
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"gemv takes a float16 or bfloat16 weight, got {weight.dtype}")
    N, K = weight.shape
    if x.shape[-1] != K or x.dtype != weight.dtype:
        raise ValueError(f"x of shape {list(x.shape)} and dtype {x.dtype} does not fit a weight of shape "
                         f"{[N, K]} and dtype {weight.dtype}")
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {M}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs a weight whose rows are contiguous")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        args = (rows, weight, bias if bias is not None else weight, out, M, N, K, rows.stride(0), weight.stride(0),
                out.stride(0))
        if _INTERPRETED:
            grid = (triton.cdiv(N, _INTERPRETED_CONFIG["BLOCK_N"]),)
            _gemv_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, **_INTERPRETED_CONFIG)
        else:
            grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
            options = pdl_options(x)
            if options:
                options.update(PREFETCH_TILES=prefetch_tiles(), LINE=128 // weight.element_size())
            _gemv_tuned[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, **options)
    return out.reshape(*x.shape[:-1], N)
