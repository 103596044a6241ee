"""Skinny matmul for decode: y = x W^T with few rows of x (batch ≤ GEMV_MAX_ROWS) and a half-precision W.

At batch 1–8 a decode step reads every weight once and does almost no arithmetic per byte, so a linear layer
is as fast as it streams W from memory. Each program owns BLOCK_N rows of W (output features) and walks K in
BLOCK_K tiles, K being W's contiguous dimension; the few rows of x (padded to 16 for the tensor-core dot)
come from L2. Accumulation is in float32, in a fixed order: results do not depend on timing (no split-K
atomics). Tile sizes are tuned per (N, K) at the first call, which is an eager warm-up before any CUDA graph
is captured.

Two fused variants take the small kernels before a decode GEMV into it: silu_mul_gemv reads gate and up and
applies silu(gate) * up as it loads (the MLP's down projection); rms_norm_gemv adds the residual and scales by
the norm's weight as it loads, sums the squares alongside the product and applies each row's 1 / RMS to the
result (RMSNorm(x) W^T = rstd * ((x * g) W^T)), so the normalised activations never go to memory and the input
is read in the one pass over K (the qkv and gate_up projections; llama.normed_linear). Its rounding differs
from the separate norm's (x * g is rounded, not x * rstd), within half precision's.

Off unless RAYLM_TRITON_GEMV=1 (see dispatch.gemv_applies) until it is measured faster than cuBLAS on
the target GPU: `python benchmarks/gemv.py`, `bash benchmarks/h200.sh gemv`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from raylm.kernels.dispatch import GEMV_MAX_ROWS

_BLOCK_M = 16  # tl.dot's smallest tile; rows past M are masked


def _configs() -> list[triton.Config]:
    """Tile shapes to time per (N, K); Triton's timing clears the L2 between runs, as a real step finds it."""
    configs = [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=4, num_stages=stages)
               for block_n in (16, 32, 64) for block_k in (128, 256) for stages in (3, 4)]
    # Wider K tiles with more warps keep more bytes of W in flight per SM when there are few programs.
    configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": 512}, num_warps=8, num_stages=stages)
                for block_n in (16, 32) for stages in (2, 3)]
    return configs


# What the kernel does to its input before the product (a constexpr: each is its own compiled variant).
_PLAIN, _SILU_MUL, _RMS_NORM = 0, 1, 2


@triton.jit
def _input_tile(x_rows, res_rows, res_out_rows, norm_w_ptr, ks, mask, K, write_residual,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] tile of the GEMV's input at columns ks, in the weight's dtype, and (for the norm
    prologue) the float32 values whose squares make the rows' norms."""
    if PROLOGUE == 1:  # silu(gate) * up, rounded as triton_ops.silu_and_mul rounds it
        gate = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + ks[None, :], mask=mask, other=0.0)
        activated = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        tile = (activated.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
        return tile, tile.to(tl.float32)
    x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
    if PROLOGUE != 2:
        return x, x.to(tl.float32)
    if HAS_RESIDUAL:  # x + residual, rounded to the input dtype as triton_ops' fused add + RMSNorm rounds it
        residual = tl.load(res_rows + ks[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
        tl.store(res_out_rows + ks[None, :], x, mask=mask & write_residual)  # one program writes the sum
    hidden = x.to(tl.float32)
    weight = tl.load(norm_w_ptr + ks, mask=ks < K, other=0.0)
    return (hidden * weight.to(tl.float32)[None, :]).to(x.dtype), hidden


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, bias_ptr, y_ptr, M, N, K,
                 stride_xm, stride_rm, stride_rom, stride_wn, stride_ym, eps,
                 HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output features = rows of W
    row_mask = rows < M
    col_mask = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows[:, None] * stride_xm
    res_rows = res_ptr + rows[:, None] * stride_rm
    res_out_rows = res_out_ptr + rows[:, None] * stride_rom
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        x, hidden = _input_tile(x_rows, res_rows, res_out_rows, norm_w_ptr, ks, row_mask[:, None] & k_mask[None, :],
                                K, pid == 0, PROLOGUE, HAS_RESIDUAL)  # [BM, BK]
        acc = tl.dot(x, tl.trans(w), acc)
        if PROLOGUE == 2:
            squares += tl.sum(hidden * hidden, axis=1)
    if PROLOGUE == 2:  # RMSNorm(x) W^T = rstd * ((x * g) W^T): the per-row scale comes out of the sum
        acc *= tl.rsqrt(squares / K + eps)[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


_gemv_tuned = triton.autotune(configs=_configs(), key=["N", "K", "PROLOGUE"])(_gemv_kernel)
# The interpreter (CPU tests; read at import, as Triton does) has no device to time configurations on: it runs one.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128}


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """x's rows as a [M, in_features] view with a contiguous last dimension, after checking what the kernel needs."""
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{name} takes a float16 or bfloat16 weight, got {weight.dtype}")
    if x.shape[-1] != in_features or x.dtype != weight.dtype:
        raise ValueError(f"x of shape {list(x.shape)} and dtype {x.dtype} does not fit a weight of shape "
                         f"{list(weight.shape)} and dtype {weight.dtype}")
    rows = x.reshape(-1, in_features)
    if rows.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"{name} takes at most {GEMV_MAX_ROWS} rows, got {rows.shape[0]}")
    if weight.stride(-1) != 1:
        raise ValueError(f"{name} needs a weight whose rows are contiguous")
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prologue: int,
            residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    N, K = weight.shape
    M = rows.shape[0]
    out = torch.empty((M, N), dtype=weight.dtype, device=rows.device)
    if M:
        res = residual if residual is not None else rows  # unused by the kernel when there is none
        res_out = residual_out if residual_out is not None else rows
        args = (rows, res, norm_weight if norm_weight is not None else weight, res_out, weight,
                bias if bias is not None else weight, out, M, N, K, rows.stride(0), res.stride(0), res_out.stride(0),
                weight.stride(0), out.stride(0), eps)
        flags = dict(HAS_BIAS=bias is not None, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
                     BLOCK_M=_BLOCK_M)
        if _INTERPRETED:
            grid = (triton.cdiv(N, _INTERPRETED_CONFIG["BLOCK_N"]),)
            _gemv_kernel[grid](*args, **flags, **_INTERPRETED_CONFIG)
        else:
            grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
            _gemv_tuned[grid](*args, **flags)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most GEMV_MAX_ROWS rows (any leading shape) and a half-precision
    weight [N, K] with contiguous rows."""
    rows = _check("gemv", x, weight, weight.shape[1])
    return _launch(rows, weight, bias, _PLAIN).reshape(*x.shape[:-1], weight.shape[0])


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for gate_up [..., 2K] holding gate then up (as
    triton_ops.silu_and_mul takes it) and weight [N, K]: the activation is computed as the input is read."""
    K = weight.shape[1]
    rows = _check("silu_mul_gemv", gate_up, weight, 2 * K)
    return _launch(rows, weight, bias, _SILU_MUL).reshape(*gate_up.shape[:-1], weight.shape[0])


def rms_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """F.linear(RMSNorm(x [+ residual]), weight, bias) and, with a residual, x + residual (as
    triton_ops.fused_add_rms_norm returns it): the norm is applied as the input is read, so the normalised
    activations never go to memory. norm_weight [K] in the weight's dtype."""
    K = weight.shape[1]
    rows = _check("rms_norm_gemv", x, weight, K)
    if norm_weight.shape != (K,) or norm_weight.dtype != weight.dtype:
        raise ValueError(f"norm_weight must be [{K}] in {weight.dtype}, got {list(norm_weight.shape)} in "
                         f"{norm_weight.dtype}")
    residual_rows = residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({list(x.shape)}, {x.dtype}), got {list(residual.shape)}, "
                             f"{residual.dtype}")
        residual_rows = _check("rms_norm_gemv", residual, weight, K)
        residual_out = torch.empty_like(rows)
    out = _launch(rows, weight, bias, _RMS_NORM, residual_rows, residual_out, norm_weight, eps)
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out, residual_out.view(x.shape) if residual_out is not None else None
