"""Skinny matmul for decode: y = x W^T with few rows of x (batch ≤ GEMV_MAX_ROWS) and a half-precision or FP8 W.

At batch 1–8 a decode step reads every weight once and does almost no arithmetic per byte, so a linear layer
is as fast as it streams W from memory. Each program owns BLOCK_N rows of W (output features) and walks K in
BLOCK_K tiles, K being W's contiguous dimension; the few rows of x (padded to 16 for the tensor-core dot)
come from L2. Accumulation is in float32, in a fixed order: results do not depend on timing. Tile sizes are
tuned per (N, K) at the first call, which is an eager warm-up before any CUDA graph is captured.

Split K: a layer with few output features (the o and qkv projections: 256-400 programs of 16 rows) streams its
weight in programs of 64-128 KiB each, and its last wave and ramp-up leave the memory system part idle (measured
2.8-3.1 TB/s against ~4.2 for the large layers). With SPLIT_K > 1 each output tile is shared by SPLIT_K programs,
each taking a contiguous 1/SPLIT_K of K: they write float32 partial sums to a workspace and bump the tile's
arrival counter; the program that arrives last adds the partials in split order (a fixed order: no atomics on
the data, so the result is the same whichever program finishes first), writes y and resets the counter for the
next call. Splits are among the tuned configurations, chosen only where they time faster.

On by default for models whose decode steps stream weights, with programmatic dependent launch (kernels/policy.py:
alone it is level with cuBLAS; with PDL's `tail` it is faster end to end); kernel_config.decode_gemv overrides.
Under PDL (kernels/pdl.py) a program loads its first weight tile before it waits for the kernel before it, and
with kernel_config.gemv_prefetch asks the L2 for that many more bytes of each of its rows (_prefetch_rows).

FP8 weights (float8_e4m3fn with a float32 scale per output row, kernels/fp8.py) stream half the bytes; the row's
scale goes on the float32 sum, and their tiles are tuned apart, with wider K tiles (the same bytes in flight). How
the FP8 tile meets x is kernel_config.fp8_gemv_input (INPUT_MODES):
- "float16": the weight is widened to float16 (one conversion per two values; bfloat16 takes three)
  and x rounded to float16, exact for bfloat16 values of magnitude 2^-14 to 65504 (larger ones are held at 65504).
  Fastest on the H200: 8B batch 1 at 3.66 ms/token against 3.99 widening to bfloat16 (docs/benchmarks.md).
- "model_dtype": the weight is widened to x's dtype (exactly: every e4m3 value is a bfloat16 / float16 value) and
  x keeps its precision.
- "fp8": x's rows are quantized per token as the FP8 matmul does (the row's amax / 448), once per call by
  triton_fp8's quantizer before the GEMV, or by the RMSNorm before qkv and gate / up (x comes as Fp8Rows: no
  quantizer kernel), and the tensor cores multiply FP8 by FP8, no widening in the loop (Hopper's FP8 warpgroup
  product where 64+ weight rows go first: under one machine instruction a weight byte, against ~7 on the CUDA
  cores). One row tunes the CUDA-core tilings and the tensor-core ones together. (Each program re-reading x's
  whole row for its amax inside the GEMV measured 14.4 ms/token.)
- "fp8_tiles": x as it comes (o's and down's input, which no kernel before them writes as FP8 rows), each
  FP8_TILE_K-wide tile quantized in the loop with a scale per row and tile that puts the tile's amax on 448
  (triton_fp8.tile_scale: one division a row, a product a value), the tile's FP8 product scaled by it as it is
  added. Every tiling is FP8_TILE_K wide in K, so the tuning cannot change the results; finer than a scale per token
  (SmolLM2's o and down: 8% less output error, docs/benchmarks.md). On the FP8 tensor cores at one row too (x
  padded to 16 rows).
kernel_config.fp8_gemv_input "fp8_rows" (the default) and "fp8_tiles" take "fp8" for the rows an RMSNorm hands over
and "float16" or "fp8_tiles" for o and down (kernels/policy.py).

One input row on FP8 weights (batch-1 decode) skips the tensor cores in the plain GEMV (CORE): the dot pads x to 16
rows and, in the float16 mode, converts all 16 every tile, as much work per tile as widening the weight when
BLOCK_N is 16. On the CUDA cores each thread multiplies its 16 weight bytes by x's matching values in float32, sums
them in its registers, and keeps a running sum per 16 columns until the loop ends; it requests the next tile before
using the current one (Triton does not pipeline loads that feed no dot). Exact products as the dot's; another
summation order. 8B batch 1: the qkv / o / down GEMVs took 2.01 ms a step against 2.32 on the dot; the gate / up
SiLU-mul GEMV keeps the dot, which streams its wide layer faster (docs/benchmarks.md).

The SiLU-mul after the gate / up projection runs in that GEMV's epilogue (gemv_silu_mul: each program owns
matching gate and up rows, so the activation needs nothing from other programs). The add + RMSNorm before qkv
and gate_up stay separate kernels: folded into the GEMV's input loads they measured slower (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from raylm.kernels import gemv_tiles
from raylm.kernels.fp8 import FP8_DTYPE, Fp8Rows
from raylm.kernels.gemv_inputs import INPUT_MODES, gemv_input
from raylm.kernels.gemv_tiles import (
    MAX_SPLIT_N,
    MIN_BLOCK_N,
    SPLITS,
    candidates,
    core_candidates,
    fp8_tile_candidates,
    tiling,
    without_splits_for_wide_layers,
)
from raylm.kernels.pdl import launch_options, pdl_trigger_at_tail, pdl_wait
from raylm.kernels.policy import GEMV_MAX_ROWS
from raylm.kernels.triton_fp8 import tile_scale

_BLOCK_M = 16  # tl.dot's smallest tile; rows past M are masked
_FLOAT16_MAX = tl.constexpr(65504.0)
_CORE_RUN = tl.constexpr(16)  # FP8 weights a thread loads in one 16-byte vector: summed in its registers each tile
# The "fp8_tiles" input mode quantizes x per row and block of this many values of K, whatever the tiling: its tiles
# are this wide in K, so that the results do not depend on which tiling the tuning chose.
FP8_TILE_K = 128


@triton.jit
def _w_tile(w_rows, ks, col_mask, K):
    """One [BLOCK_N, BLOCK_K] tile of weight rows."""
    return tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _x_tile(x_rows, ks, row_mask, K):
    """One [BLOCK_M, BLOCK_K] tile of the input rows."""
    return tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _x_scales(x_scale_ptr, rows, row_mask, BLOCK_M: tl.constexpr, X_MODE: tl.constexpr):
    """Each input row's FP8 scale when X_MODE is 2 (x quantized before the call); 1.0 for every row otherwise."""
    if X_MODE == 2:
        return tl.load(x_scale_ptr + rows, mask=row_mask, other=1.0)
    else:
        return tl.full([BLOCK_M], 1.0, tl.float32)


@triton.jit
def _x_operand(x, X_MODE: tl.constexpr):
    """x's tile ([BLOCK_M, BLOCK_K]) as _dot takes it, and its rows' scales ([BLOCK_M] float32): X_MODE 1, rounded
    to float16, inputs past its range held at its largest value rather than made infinite; 3, quantized to FP8 here
    with a scale per row that puts the row's amax in the tile (FP8_TILE_K wide) on 448 (tile_scale); other modes as
    it is, scales 1.0."""
    if X_MODE == 3:
        values = x.to(tl.float32)
        scale, inverse = tile_scale(tl.max(tl.abs(values), axis=1))
        return (values * inverse[:, None]).to(tl.float8e4nv), scale  # 448 at most, a rounding aside (it saturates)
    elif X_MODE == 1:
        return (tl.clamp(x.to(tl.float32), -_FLOAT16_MAX, _FLOAT16_MAX).to(tl.float16),
                tl.full([x.shape[0]], 1.0, tl.float32))
    else:
        return x, tl.full([x.shape[0]], 1.0, tl.float32)


@triton.jit
def _dot(x, x_tile_scale, w, acc, X_MODE: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + x w^T ([BLOCK_M, BLOCK_N]), or with SWAP_AB its transpose acc + w x^T ([BLOCK_N, BLOCK_M]: the weight
    tile as the dot's first operand, in the order it is stored), x as _x_operand gives it, by X_MODE: 0, w widened
    to x's dtype (a no-op for a half-precision w); 1, both in float16; 2, x's FP8 rows (their scales go on in the
    epilogue) and the FP8 w as they are; 3, x's tile in FP8 and the FP8 w as they are, the product scaled by the
    tile's scales (x_tile_scale) as it is added."""
    if X_MODE == 1:
        w = w.to(tl.float16)
    elif X_MODE == 0:
        w = w.to(x.dtype)
    if X_MODE == 3:
        if SWAP_AB:
            return acc + tl.dot(w, tl.trans(x)) * x_tile_scale[None, :]
        else:
            return acc + tl.dot(x, tl.trans(w)) * x_tile_scale[:, None]
    if SWAP_AB:
        return tl.dot(w, tl.trans(x), acc)
    else:
        return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _core_fma(x, w, acc, X_MODE: tl.constexpr):
    """acc + x's row ([BLOCK_K]) times each weight row, element by element on the CUDA cores: acc is [BLOCK_N,
    BLOCK_K // 16] float32, each thread's 16 products of a row summed in its registers every tile, the rest summed
    over K once after the loop. For one input row, where the tensor-core dot pads x to 16 rows and converts all 16
    every tile. The products are exact in float32 (an e4m3 value times a 16-bit one), as the dot's are."""
    if X_MODE == 1:  # x rounded to float16 as the dot's float16 mode rounds it
        x = tl.clamp(x.to(tl.float32), -_FLOAT16_MAX, _FLOAT16_MAX).to(tl.float16)
    products = w.to(tl.float32) * x.to(tl.float32)[None, :]
    BLOCK_N: tl.constexpr = products.shape[0]
    BLOCK_K: tl.constexpr = products.shape[1]
    return acc + tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // _CORE_RUN, _CORE_RUN]), axis=2)


@triton.jit
def _core_x(x_ptr, ks, K):
    """One [BLOCK_K] tile of the input's only row."""
    return tl.load(x_ptr + ks, mask=ks < K, other=0.0)


@triton.jit
def _core_sums(x_ptr, w_rows, w, ks, col_mask, k_start, k_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               X_MODE: tl.constexpr, CORE_AHEAD: tl.constexpr):
    """x's row times W's rows over K from k_start to k_end on the CUDA cores ([1, BLOCK_N] float32), w being the
    first weight tile (at ks), loaded already. Each tile's CORE_AHEAD successors (1 or 2) are requested before the
    tile is multiplied, so CORE_AHEAD + 1 tiles of every program are in flight: more bytes in flight per SM where a
    narrow layer has few programs an SM. A tile past k_end loads as zeros and adds nothing (the same sums)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K // _CORE_RUN], dtype=tl.float32)
    if CORE_AHEAD == 2:
        ks_next = ks + BLOCK_K
        w_next = _w_tile(w_rows, ks_next, col_mask, k_end)
        for start in range(k_start + 2 * BLOCK_K, k_end, BLOCK_K):
            following = start + tl.arange(0, BLOCK_K)
            w_after = _w_tile(w_rows, following, col_mask, k_end)
            acc = _core_fma(_core_x(x_ptr, ks, k_end), w, acc, X_MODE)
            w, ks = w_next, ks_next
            w_next, ks_next = w_after, following
        acc = _core_fma(_core_x(x_ptr, ks, k_end), w, acc, X_MODE)
        w, ks = w_next, ks_next
    else:
        for start in range(k_start + BLOCK_K, k_end, BLOCK_K):
            following = start + tl.arange(0, BLOCK_K)
            w_next = _w_tile(w_rows, following, col_mask, k_end)
            acc = _core_fma(_core_x(x_ptr, ks, k_end), w, acc, X_MODE)
            w = w_next
            ks = following
    acc = _core_fma(_core_x(x_ptr, ks, k_end), w, acc, X_MODE)
    return tl.sum(acc, axis=1)[None, :]


@triton.jit
def _zero_sums(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The float32 sums _dot accumulates into: [BLOCK_N, BLOCK_M] with SWAP_AB, else [BLOCK_M, BLOCK_N]."""
    if SWAP_AB:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _rows_first(acc, SWAP_AB: tl.constexpr):
    """_dot's sums as [BLOCK_M, BLOCK_N]."""
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _prefetch_rows(w_rows, k_start, k_end, FP8_W: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """Asks the L2 for PREFETCH bytes of each of the program's weight rows after its first tile (one request a
    128-byte line; lines past the program's part of K ask for its first line again). A GEMV does this before its
    PDL wait, so that under PDL its weights stream from memory while the small kernels before it finish, and its
    loop then reads them from the L2 (kernel_config.gemv_prefetch)."""
    LINE: tl.constexpr = 128 if FP8_W else 64  # weights a 128-byte line holds
    ks = k_start + BLOCK_K + tl.arange(0, PREFETCH // 128) * LINE
    ks = tl.where(ks < k_end, ks, k_start)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [w_rows + ks[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(x_ptr, x_scale_ptr, w_ptr, bias_ptr, scale_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K,
                 stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1,
                 USE_PDL: tl.constexpr = 0, X_MODE: tl.constexpr = 0, SWAP_AB: tl.constexpr = 0,
                 CORE: tl.constexpr = 0, CORE_AHEAD: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
    """Program (i, s) computes output features [i BLOCK_N, (i + 1) BLOCK_N) over split s of K (the whole of K
    when SPLIT_K is 1); with SPLIT_K > 1, partial_ptr is a float32 workspace of at least [SPLIT_K, M, N] and
    arrivals_ptr one int32 counter per output tile, zero between calls. HAS_SCALE: W holds FP8 rows, each scaled by
    its float32 scale_ptr[n]; X_MODE 2: so does x, by x_scale_ptr[m]. CORE: one input row (BLOCK_M 1), multiplied
    on the CUDA cores (_core_sums, its loads CORE_AHEAD tiles ahead). PREFETCH: bytes of each weight row the L2 is
    asked for before the PDL wait (_prefetch_rows), 0 for none."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output features = rows of W
    row_mask = rows < M
    col_mask = cols < N
    out_mask = row_mask[:, None] & col_mask[None, :]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    # This program's part of K: whole tiles, the last split taking what is left (possibly nothing).
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * chunk
    k_end = tl.minimum(K, k_start + chunk)
    # The first weight tile is requested before pdl_wait: weights are not written during a step, so under PDL it
    # streams in while the kernel before finishes.
    ks = k_start + tl.arange(0, BLOCK_K)
    w = _w_tile(w_rows, ks, col_mask, k_end)
    if PREFETCH:
        _prefetch_rows(w_rows, k_start, k_end, HAS_SCALE, BLOCK_K, PREFETCH)
    pdl_wait(USE_PDL, TRIGGER_AT_TAIL=True)
    x_scale = _x_scales(x_scale_ptr, rows, row_mask, BLOCK_M, X_MODE)
    if CORE:
        acc = _core_sums(x_ptr, w_rows, w, ks, col_mask, k_start, k_end, BLOCK_N, BLOCK_K, X_MODE, CORE_AHEAD)
        pdl_trigger_at_tail(USE_PDL)
    else:
        x, x_tile_scale = _x_operand(_x_tile(x_rows, ks, row_mask, k_end), X_MODE)
        acc = _dot(x, x_tile_scale, w, _zero_sums(BLOCK_M, BLOCK_N, SWAP_AB), X_MODE, SWAP_AB)
        for start in range(k_start + BLOCK_K, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x, x_tile_scale = _x_operand(_x_tile(x_rows, ks, row_mask, k_end), X_MODE)
            acc = _dot(x, x_tile_scale, _w_tile(w_rows, ks, col_mask, k_end), acc, X_MODE, SWAP_AB)
        pdl_trigger_at_tail(USE_PDL)
        acc = _rows_first(acc, SWAP_AB)
    if SPLIT_K > 1:
        tile = rows[:, None] * N + cols[None, :]
        tl.store(partial_ptr + split * M * N + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is announced
        arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last program of the tile sums the partials, in split order
            acc = tl.load(partial_ptr + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            for other in tl.static_range(1, SPLIT_K):
                acc += tl.load(partial_ptr + other * M * N + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            _gemv_store(acc, bias_ptr, scale_ptr, y_ptr, rows, cols, col_mask, out_mask, stride_ym, HAS_BIAS,
                        HAS_SCALE, x_scale, X_MODE)
            tl.atomic_xchg(arrivals_ptr + pid, 0)  # ready for the next call
    else:
        _gemv_store(acc, bias_ptr, scale_ptr, y_ptr, rows, cols, col_mask, out_mask, stride_ym, HAS_BIAS, HAS_SCALE,
                    x_scale, X_MODE)


@triton.jit
def _gemv_store(acc, bias_ptr, scale_ptr, y_ptr, rows, cols, col_mask, out_mask, stride_ym, HAS_BIAS: tl.constexpr,
                HAS_SCALE: tl.constexpr, x_scale, X_MODE: tl.constexpr):
    """y = acc (* the input rows' scales) (* the weight rows' scales) (+ bias), rounded to y's dtype."""
    if X_MODE == 2:
        acc *= x_scale[:, None]
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemv_silu_mul_kernel(x_ptr, x_scale_ptr, w_ptr, bias_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                          stride_ym, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = 0,
                          X_MODE: tl.constexpr = 0, SWAP_AB: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    """silu(x W_gate^T) * (x W_up^T) for W = [W_gate; W_up] ([2N, K]): each program takes BLOCK_N gate rows and
    the matching up rows, and rounds as linear followed by silu_and_mul does (each projection to y's dtype,
    then the activation, then the product). PREFETCH as the plain GEMV takes it, for the gate and the up rows."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    gate_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N.to(tl.int64) * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    ks = tl.arange(0, BLOCK_K)
    w_gate = _w_tile(gate_rows, ks, col_mask, K)
    w_up = _w_tile(up_rows, ks, col_mask, K)
    if PREFETCH:
        _prefetch_rows(gate_rows, 0, K, HAS_SCALE, BLOCK_K, PREFETCH)
        _prefetch_rows(up_rows, 0, K, HAS_SCALE, BLOCK_K, PREFETCH)
    pdl_wait(USE_PDL, TRIGGER_AT_TAIL=True)
    x_scale = _x_scales(x_scale_ptr, rows, row_mask, BLOCK_M, X_MODE)
    x, x_tile_scale = _x_operand(_x_tile(x_rows, ks, row_mask, K), X_MODE)
    acc_gate = _dot(x, x_tile_scale, w_gate, _zero_sums(BLOCK_M, BLOCK_N, SWAP_AB), X_MODE, SWAP_AB)
    acc_up = _dot(x, x_tile_scale, w_up, _zero_sums(BLOCK_M, BLOCK_N, SWAP_AB), X_MODE, SWAP_AB)
    for start in range(BLOCK_K, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x, x_tile_scale = _x_operand(_x_tile(x_rows, ks, row_mask, K), X_MODE)
        acc_gate = _dot(x, x_tile_scale, _w_tile(gate_rows, ks, col_mask, K), acc_gate, X_MODE, SWAP_AB)
        acc_up = _dot(x, x_tile_scale, _w_tile(up_rows, ks, col_mask, K), acc_up, X_MODE, SWAP_AB)
    pdl_trigger_at_tail(USE_PDL)
    acc_gate = _rows_first(acc_gate, SWAP_AB)
    acc_up = _rows_first(acc_up, SWAP_AB)
    if X_MODE == 2:
        acc_gate *= x_scale[:, None]
        acc_up *= x_scale[:, None]
    if HAS_SCALE:
        acc_gate *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
        acc_up *= tl.load(scale_ptr + N + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc_gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    gate = acc_gate.to(y_ptr.dtype.element_ty).to(tl.float32)
    up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, (activated.to(tl.float32) * up).to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def _tiles_say_rows(core: bool, input_mode: int) -> bool:
    """Whether the tuned tilings of a variant set BLOCK_M (and CORE) themselves: one FP8 row, which may take the
    CUDA or the tensor cores (_tuned)."""
    return core and input_mode == INPUT_MODES["fp8"]


def _tuned(kernel, split: bool, fp8: bool, core: bool, input_mode: int = 0):
    prune = {"early_config_prune": without_splits_for_wide_layers} if split else None
    if _tiles_say_rows(core, input_mode):
        # One FP8 row of x against FP8 weights: the CUDA cores or the FP8 tensor cores (x padded to _BLOCK_M rows),
        # whichever times faster; each tiling says which (CORE, BLOCK_M).
        configs = [_with(config, BLOCK_M=_CORE_ROWS) for config in core_candidates(split)]
        configs += [_with(config, BLOCK_M=_BLOCK_M, CORE=0) for config in candidates(split, fp8)]
    elif input_mode == INPUT_MODES["fp8_tiles"]:
        configs = fp8_tile_candidates(split, FP8_TILE_K)
    else:
        configs = core_candidates(split) if core else candidates(split, fp8)
    return gemv_tiles.autotune(kernel, configs, prune)


def _with(config: triton.Config, **kwargs) -> triton.Config:
    """config with more of the kernel's constexprs set."""
    return triton.Config({**config.kwargs, **kwargs}, num_warps=config.num_warps, num_stages=config.num_stages)


# Where a GEMV's tiles come from when no config is given: timed at a layer shape's first call, or shipped for the GPU
# model (kernels/gemv_tiles.py).
TILE_SOURCES = ("tune", "shipped")
# A plain GEMV of one row on FP8 weights multiplies on the CUDA cores (CORE; in the fp8 input mode where that times
# faster than the FP8 tensor cores); more rows, and the SiLU-mul GEMV, take the tensor-core dot (on the CUDA cores
# the 8B gate / up layer measured 1.6 ms a step against 1.0).
_CORE_ROWS = 1
# Tuned kernels by (whether the weight is FP8, the input mode, whether they multiply on the CUDA cores); the CUDA
# cores only for the plain GEMV.
_VARIANTS = ((False, 0, False), *((True, mode, False) for mode in (0, 1, 2, 3)))
_CORE_VARIANTS = tuple((True, mode, True) for mode in (0, 1, 2))
_gemv_tuned = {(fp8, mode, core): _tuned(_gemv_kernel, True, fp8, core, mode)
               for fp8, mode, core in (*_VARIANTS, *_CORE_VARIANTS)}
_gemv_silu_mul_tuned = {(fp8, mode, core): _tuned(_gemv_silu_mul_kernel, False, fp8, core, mode)
                        for fp8, mode, core in _VARIANTS}
# The interpreter (CPU tests; read at import, as Triton does) has no device to time configurations on: it runs one.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128}
# Split-K workspaces per (device, N): float32 partials for up to max(SPLITS) splits of GEMV_MAX_ROWS rows, and
# the output tiles' arrival counters (zero between calls: the last program of a tile resets its counter). Calls
# on one device share them, so GEMVs of one device run on one stream at a time (as the engine's forward does).
_workspaces: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _tile_source(tiles: str) -> str:
    if tiles not in TILE_SOURCES:
        raise ValueError(f"tiles must be one of {TILE_SOURCES}, got {tiles!r}")
    return tiles


def _split_workspace(device: torch.device, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    workspace = _workspaces.get((device, N))
    if workspace is None:
        partial = torch.empty(max(SPLITS) * GEMV_MAX_ROWS * N, dtype=torch.float32, device=device)
        arrivals = torch.zeros(triton.cdiv(N, MIN_BLOCK_N), dtype=torch.int32, device=device)
        workspace = _workspaces[(device, N)] = (partial, arrivals)
    return workspace


@functools.cache
def _variant_name(kernel, weight_dtype: torch.dtype, x_dtype: torch.dtype, input_mode: int, core: bool) -> str:
    """The name of what a tuning is for, beside (N, K): the kernel, the weight's and input's dtypes, the input mode
    of an FP8 weight and whether it multiplies on the CUDA cores ("gemv float8_e4m3fn/float16 core x=bfloat16")."""
    name = "gemv_silu_mul" if kernel is _gemv_silu_mul_kernel else "gemv"
    weight_type = str(weight_dtype).removeprefix("torch.")
    if weight_dtype == FP8_DTYPE:
        weight_type += "/" + next(mode for mode, value in INPUT_MODES.items() if value == input_mode)
    return f"{name} {weight_type} {'core' if core else 'dot'} x={str(x_dtype).removeprefix('torch.')}"


@functools.cache
def _shipped_tiling(kernel, weight_dtype: torch.dtype, x_dtype: torch.dtype, input_mode: int, core: bool,
                    device: torch.device, N: int, K: int) -> dict | None:
    """The tiling gemv_tiles.json ships for this variant, shape and GPU model, if the variant's tuning still offers
    it (split K only where the tuning would consider it). Looked up once per layer shape."""
    offer = gemv_tiles.shipped(device, _variant_name(kernel, weight_dtype, x_dtype, input_mode, core), N, K)
    if offer is None or (offer.get("SPLIT_K", 1) > 1 and N > MAX_SPLIT_N):
        return None
    tuned = _gemv_silu_mul_tuned if kernel is _gemv_silu_mul_kernel else _gemv_tuned
    offered = tuned[(weight_dtype == FP8_DTYPE, input_mode, core)].configs
    return offer if any(tiling(config) == offer for config in offered) else None


def _launch(kernel, tuned, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            weight_scale: torch.Tensor | None, out: torch.Tensor, N: int, config: dict | None, pdl: int,
            workspace: tuple[torch.Tensor, torch.Tensor] | None = None, input_mode: int = 0,
            x_scale: torch.Tensor | None = None, tiles: str = "tune", prefetch: int = 0) -> None:
    """Runs a GEMV kernel over N output features of out [M, N]: tuned per (N, K) (`tuned`, by the variant: FP8
    weight, INPUT_MODES value; with tiles "shipped", the tiling gemv_tiles.json has for the GPU model, where it has
    one, without tuning), or with `config` (the interpreter's one configuration when none is given there);
    with PDL's trigger mode `pdl`. A kernel that may split K takes its (partials, arrivals) `workspace` after out;
    `x_scale`, FP8 rows' scales; `prefetch`, bytes of each weight row asked of the L2 before the PDL wait."""
    M, K = rows.shape
    if not M:
        return
    splittable = workspace is not None
    args = (rows, x_scale if x_scale is not None else weight, weight, bias if bias is not None else weight,
            weight_scale if weight_scale is not None else weight,
            out, *(workspace or ()), M, N, K, rows.stride(0), weight.stride(0), out.stride(0))
    # One row of a plain GEMV on FP8 weights multiplies on the CUDA cores (unless a given configuration says
    # otherwise), except where x is quantized a tile at a time: for the FP8 tensor cores.
    core_row = (kernel is _gemv_kernel and weight_scale is not None and M <= _CORE_ROWS
                and input_mode != INPUT_MODES["fp8_tiles"])
    if config is None and tiles == "shipped":
        config = _shipped_tiling(kernel, weight.dtype, rows.dtype, input_mode, core_row, rows.device, N, K)
    if _INTERPRETED and config is None:
        config = _INTERPRETED_CONFIG
    core = bool(config.get("CORE", 0)) if config is not None else core_row
    if core and (M > _CORE_ROWS or kernel is not _gemv_kernel):
        raise ValueError(f"CORE multiplies at most {_CORE_ROWS} input row, in the plain GEMV; got M={M}")
    if input_mode == INPUT_MODES["fp8_tiles"] and config is not None and (core or config.get("BLOCK_K") != FP8_TILE_K):
        raise ValueError(f"input_mode 'fp8_tiles' takes tiles of BLOCK_K={FP8_TILE_K} on the tensor cores (the "
                         f"quantization's block), got {config}")
    flags = {"HAS_BIAS": bias is not None, "HAS_SCALE": weight_scale is not None, "X_MODE": input_mode}
    if not ("BLOCK_M" in config if config is not None else _tiles_say_rows(core, input_mode)):
        flags["BLOCK_M"] = _CORE_ROWS if core else _BLOCK_M
    if prefetch and not _INTERPRETED:  # the interpreter runs no inline assembly
        flags["PREFETCH"] = _prefetch_bytes(prefetch)
    options = launch_options(pdl)
    if config is not None:
        config = dict(config)
        split_k = config.get("SPLIT_K", 1)
        if split_k > 1 and not (splittable and split_k <= max(SPLITS) and N <= MAX_SPLIT_N):
            raise ValueError(f"SPLIT_K={split_k} needs the plain GEMV, at most {max(SPLITS)} splits and at most "
                             f"{MAX_SPLIT_N} output features")
        grid = (triton.cdiv(N, config["BLOCK_N"]), split_k)
        kernel[grid](*args, **flags, **config, **options)
        return
    autotuner = tuned[(weight_scale is not None, input_mode, core)]
    autotuner[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta.get("SPLIT_K", 1))](*args, **flags, **options)
    gemv_tiles.note(rows.device, _variant_name(kernel, weight.dtype, rows.dtype, input_mode, core), N, K,
                    autotuner.best_config)


def _prefetch_bytes(prefetch: int) -> int:
    if prefetch < 128 or prefetch & (prefetch - 1):
        raise ValueError(f"prefetch must be 0 or a power of two of at least 128 bytes, got {prefetch}")
    return prefetch


def gemv(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         weight_scale: torch.Tensor | None = None, input_mode: str = "model_dtype", config: dict | None = None,
         pdl: int = 0, tiles: str = "tune", prefetch: int = 0) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most GEMV_MAX_ROWS rows (any leading shape) and a half-precision
    weight [N, K] with contiguous rows, or an FP8 one with its float32 weight_scale [N] (F.linear of x and the
    dequantized weight; input_mode, an INPUT_MODES key, says how: with "fp8", F.linear of x quantized per row to
    FP8 and dequantized, as kernels/fp8.py's fp8_linear). `config` fixes the tiles ({"BLOCK_N", "BLOCK_K"[,
    "SPLIT_K"]}, and Triton's num_warps / num_stages) instead of tuning them: for tests and benchmarks. `pdl`: the
    launch's trigger mode (kernels/pdl.py). `tiles`: "tune" times the candidate tilings at a layer shape's
    first call; "shipped" takes gemv_tiles.json's tiling for the GPU model where it has one (TILE_SOURCES).
    `prefetch`: bytes of each weight row (0, or a power of two from 128) that each program asks the L2 for before
    its PDL wait, past its first tile (kernel_config.gemv_prefetch). In the "fp8" mode x may come quantized
    (kernels/fp8.py's Fp8Rows, as the RMSNorm before the layer writes them), and is not quantized again."""
    tiles = _tile_source(tiles)
    rows, x_scale, dtype, leading = gemv_input(x, weight, weight_scale, "gemv", input_mode)
    N = weight.shape[0]
    out = torch.empty((rows.shape[0], N), dtype=dtype, device=rows.device)
    # Layers too wide to split pass out twice in the workspace's place: the kernel never touches it unsplit.
    workspace = _split_workspace(rows.device, N) if N <= MAX_SPLIT_N else (out, out)
    _launch(_gemv_kernel, _gemv_tuned, rows, weight, bias, weight_scale, out, N, config, pdl, workspace,
            INPUT_MODES[input_mode], x_scale, tiles, prefetch)
    return out.reshape(*leading, N)


def gemv_silu_mul(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  weight_scale: torch.Tensor | None = None, input_mode: str = "model_dtype",
                  config: dict | None = None, pdl: int = 0, tiles: str = "tune", prefetch: int = 0) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight, bias)) in one kernel, for x as gemv takes it and a merged gate / up
    weight [2I, K] (gate rows, then up rows; bias and an FP8 weight's weight_scale likewise): returns [..., I],
    rounded as the two steps round. `input_mode`, `config`, `pdl`, `tiles` and `prefetch` as gemv takes them,
    without SPLIT_K (the gate / up layer is wide enough not to need it)."""
    tiles = _tile_source(tiles)
    if weight.shape[0] % 2:
        raise ValueError(f"gemv_silu_mul needs gate and up rows of one size, got {weight.shape[0]} rows")
    rows, x_scale, dtype, leading = gemv_input(x, weight, weight_scale, "gemv_silu_mul", input_mode)
    N = weight.shape[0] // 2
    out = torch.empty((rows.shape[0], N), dtype=dtype, device=rows.device)
    _launch(_gemv_silu_mul_kernel, _gemv_silu_mul_tuned, rows, weight, bias, weight_scale, out, N, config, pdl,
            input_mode=INPUT_MODES[input_mode], x_scale=x_scale, tiles=tiles, prefetch=prefetch)
    return out.reshape(*leading, N)
