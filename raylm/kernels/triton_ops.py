"""Fused elementwise kernels in Triton: RMSNorm (with a residual add), rotary embedding, SiLU-and-mul; the norm and
SiLU-and-mul also with their rows quantized to FP8 for an FP8 matmul after them (kernels/fp8.py's Fp8Rows).

Each matches its torch reference (norm.py, rotary.py, activation.py) step for step: arithmetic runs in
float32 and results are rounded to the tensor dtype where the reference rounds them, so float32 inputs agree
to rounding error and half-precision inputs to about one unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.fp8 import FP8_DTYPE, FP8_SCALE_DTYPE, Fp8Rows
from raylm.kernels.pdl import launch_options, pdl_wait
from raylm.kernels.triton_fp8 import fp8_scale, to_fp8

# ------------------------------------------------------------------------------------------ RMSNorm


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, rows, hidden_size, eps,
                     stride_x, stride_residual, stride_out, stride_residual_out, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0, scale_ptr=None, QUANTIZE: tl.constexpr = False,
                     extra_ptr=None, stride_extra=0, HAS_EXTRA: tl.constexpr = False):
    """One program a row. With QUANTIZE, the row (rounded to x's dtype) is stored quantized to FP8 in out_ptr, its
    scale at scale_ptr, as triton_fp8's quantize_rows_fp8 would store it. With HAS_EXTRA, x first gains the float32
    row at extra_ptr, rounded to x's dtype (LoRA products left to add, models/lora.py)."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_EXTRA:
        extra = tl.load(extra_ptr + row * stride_extra + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + extra.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    hidden = x.to(tl.float32)
    variance = tl.sum(hidden * hidden, axis=0) / hidden_size
    normed = (hidden * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    if QUANTIZE:
        out = out.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(out), axis=0))
        tl.store(out_ptr + row * stride_out + cols, to_fp8(out, scale), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last dim] tensor with a contiguous last dimension (a view where possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 else rows.contiguous()


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     pdl: int, quantize: bool = False,
                     extra: torch.Tensor | None = None) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor | None]:
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight must be [{hidden_size}], got {list(weight.shape)}")
    x_rows = _rows(x)
    if extra is not None and (extra.shape != x.shape or extra.dtype != torch.float32 or extra.stride(-1) != 1):
        raise ValueError(f"extra must be float32 [{', '.join(map(str, x.shape))}] with contiguous rows, got "
                         f"{extra.dtype} {list(extra.shape)}")
    extra_rows = extra.view(-1, hidden_size) if extra is not None else None
    if quantize:
        if weight.dtype != x.dtype:
            raise ValueError(f"FP8 rows take a weight in x's dtype ({x.dtype}), got {weight.dtype}")
        out_rows = torch.empty(x_rows.shape, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(x_rows.shape[0], dtype=FP8_SCALE_DTYPE, device=x.device)
        out = Fp8Rows(out_rows, scale, x.dtype)
    else:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        out_rows = out.view(-1, hidden_size)
        scale = None
    if residual is None:
        residual_rows = residual_out_rows = x_rows  # unused by the kernel
        residual_out = None
    else:
        residual_rows = _rows(residual)
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        residual_out_rows = residual_out.view(-1, hidden_size)
    rows = x_rows.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(rows,)](
            x_rows, residual_rows, weight.contiguous(), out_rows, residual_out_rows, rows, hidden_size, eps,
            x_rows.stride(0), residual_rows.stride(0), out_rows.stride(0), residual_out_rows.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
            scale_ptr=scale, QUANTIZE=quantize, extra_ptr=extra_rows,
            stride_extra=extra_rows.stride(0) if extra_rows is not None else 0, HAS_EXTRA=extra is not None,
            **launch_options(pdl),
        )
    return out, residual_out


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x ({list(x.shape)}, {x.dtype}), got "
                         f"{list(residual.shape)}, {residual.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: int = 0) -> torch.Tensor:
    """RMSNorm over the last dimension, as norm.rms_norm: the variance and the normalisation in float32,
    the result cast to x's dtype and then scaled by weight (output dtype: x's and weight's promoted). `pdl`: the
    launch's trigger mode (kernels/pdl.py)."""
    out, _ = _launch_rms_norm(x, None, weight, eps, pdl)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       pdl: int = 0, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) in one pass; the sum is rounded to x's dtype before it
    is normalised, as RMSNorm.forward does. Neither input is modified. `pdl` as rms_norm takes it. extra: float32
    [*, hidden] that x gains first, rounded to x's dtype (as x.add_(extra) would), in the same pass."""
    _check_residual(x, residual)
    out, new_residual = _launch_rms_norm(x, residual, weight, eps, pdl, extra=extra)
    return out, new_residual


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 pdl: int = 0) -> tuple[Fp8Rows, torch.Tensor | None]:
    """rms_norm (with residual, fused_add_rms_norm) whose rows come out quantized to FP8 per token, for an FP8
    matmul: the bytes and scales quantize_fp8 gives for the rounded rows, without writing them in x's dtype first.
    Returns (Fp8Rows [rows, hidden], the new residual or None); weight in x's dtype."""
    if residual is not None:
        _check_residual(x, residual)
    return _launch_rms_norm(x, residual, weight, eps, pdl, quantize=True)


# ------------------------------------------------------------------------------------------ rotary


@triton.jit
def cos_sin_row(cos_ptr, sin_ptr, token, stride_cos, stride_sin, dims, dim_mask):
    """One token's cos and sin rows, each [1, BLOCK_D] in float32."""
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dim_mask, other=0.0).to(tl.float32)
    return cos[None, :], sin[None, :]


@triton.jit
def rows_plus(x_ptr, add_ptr, offsets, mask, ADD: tl.constexpr = False):
    """x's values at `offsets` in float32; with ADD, plus float32 addends at the same offsets of add_ptr (a LoRA
    layer's products laid out as x), the sum rounded to x's dtype first, as x.add_(addends) would store it."""
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(add_ptr + offsets, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def rotated_rows(x_ptr, offsets, dims, mask, cos, sin, half, add_ptr=None, ADD: tl.constexpr = False):
    """NeoX rotate-half of the rows of x at `offsets` ([R, 1]; each row D values along `dims`), in float32:
    x[d] cos[d] - x[d + half] sin[d] for d < half, x[d] cos[d] + x[d - half] sin[d] beyond. Every kernel that
    rotates (here, the cache write, the decode attention) goes through this one expression, so that they all
    round alike. With ADD, x is first the sum of x and add_ptr's addends (rows_plus)."""
    lower = dims < half
    partner = tl.where(lower, dims + half, dims - half)
    x = rows_plus(x_ptr, add_ptr, offsets + dims[None, :], mask, ADD)
    other = rows_plus(x_ptr, add_ptr, offsets + partner[None, :], mask, ADD)
    return tl.where(lower[None, :], x * cos - other * sin, x * cos + other * sin)


@triton.jit
def rotate_heads(x_ptr, out_ptr, token, cos, sin, num_heads, half, dims, dim_mask, stride_t, stride_h,
                 stride_out_t, stride_out_h, BLOCK_H: tl.constexpr):
    """Stores the rotated heads of one token (rotated_rows) at out, rounded to out's dtype."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < num_heads) & dim_mask[None, :]
    rotated = rotated_rows(x_ptr, token * stride_t + heads * stride_h, dims, mask, cos, sin, half)
    tl.store(out_ptr + token * stride_out_t + heads * stride_out_h + dims[None, :],
             rotated.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, num_q_heads, num_k_heads, head_dim,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                   stride_q_out_t, stride_q_out_h, stride_k_out_t, stride_k_out_h,
                   BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    half = head_dim // 2
    cos, sin = cos_sin_row(cos_ptr, sin_ptr, token, stride_cos, stride_sin, dims, dim_mask)
    rotate_heads(q_ptr, q_out_ptr, token, cos, sin, num_q_heads, half, dims, dim_mask, stride_qt, stride_qh,
                 stride_q_out_t, stride_q_out_h, BLOCK_HQ)
    rotate_heads(k_ptr, k_out_ptr, token, cos, sin, num_k_heads, half, dims, dim_mask, stride_kt, stride_kh,
                 stride_k_out_t, stride_k_out_h, BLOCK_HK)


def rope_rows(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as [T, D] rows with a contiguous last dimension, after checking them and q [T, H_q, D],
    k [T, H_k, D] for a rotation."""
    num_tokens, _, head_dim = q.shape
    if k.shape != (num_tokens, k.shape[1], head_dim) or head_dim % 2:
        raise ValueError(f"q and k must be [T, H, D] with one T and one even D, got {list(q.shape)} and "
                         f"{list(k.shape)}")
    cos_rows, sin_rows = _rows(cos), _rows(sin)
    if cos_rows.shape != (num_tokens, head_dim) or sin_rows.shape != (num_tokens, head_dim):
        raise ValueError(f"cos and sin must hold [{num_tokens}, {head_dim}] values, got {list(cos.shape)} and "
                         f"{list(sin.shape)}")
    return cos_rows, sin_rows


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding, as rotary.apply_rotary; returns new (q, k) and leaves the inputs intact.

    q: [T, H_q, D], k: [T, H_k, D]; cos, sin: one row of D values per token ([T, D], or [T, 1, D] as
    RotaryEmbedding.cos_sin gives them). The rotation is computed in float32 and rounded once.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    cos_rows, sin_rows = rope_rows(q, k, cos, sin)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, cos_rows, sin_rows, q_out, k_out, num_q_heads, num_k_heads, head_dim,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_rows.stride(0), sin_rows.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        )
    return q_out, k_out


# ------------------------------------------------------------------------------------------ SiLU-and-mul


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in float32, rounded to dtype where the reference rounds: the activation before the product,
    as F.silu(gate) * up rounds it, and the product."""
    gate = gate.to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    return (activated.to(tl.float32) * up.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _silu_mul_row(gate_up_ptr, row, cols, mask, size, stride_in, extra_ptr, stride_extra, HAS_EXTRA: tl.constexpr):
    """_silu_mul at `cols` of a row. HAS_EXTRA: gate and up first gain the row's float32 values at extra_ptr (LoRA
    products left to add), rounded as gate_up.add_(extra) would."""
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + size + cols, mask=mask, other=0.0)
    if HAS_EXTRA:
        extra = extra_ptr + row * stride_extra + cols
        gate = (gate.to(tl.float32) + tl.load(extra, mask=mask, other=0.0)).to(dtype)
        up = (up.to(tl.float32) + tl.load(extra + size, mask=mask, other=0.0)).to(dtype)
    return _silu_mul(gate, up, dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = 0, extra_ptr=None, stride_extra=0, HAS_EXTRA: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    out = _silu_mul_row(gate_up_ptr, row, cols, mask, size, stride_in, extra_ptr, stride_extra, HAS_EXTRA)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


# silu_and_mul_fp8's chunk of a row (features): a row up to it is held whole in one program, a longer one read twice,
# its amax first.
SILU_FP8_CHUNK = 32768


@triton.jit
def _silu_and_mul_fp8_kernel(gate_up_ptr, out_ptr, scale_ptr, size, stride_in, stride_out, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr = 0):
    """One program a row: silu(gate) * up rounded as _silu_and_mul_kernel rounds it, then quantized to FP8 by the
    row's amax, as triton_fp8's quantize_rows_fp8 would. A row of at most BLOCK features is held whole; a longer one
    is read in chunks of BLOCK twice, for its amax, then to quantize it (the second read mostly from the L2), so
    that no program holds a row in registers and many rows' loads are in flight on each multiprocessor."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    if size <= BLOCK:
        cols = tl.arange(0, BLOCK)
        mask = cols < size
        out = _silu_mul_row(gate_up_ptr, row, cols, mask, size, stride_in, gate_up_ptr, 0, False)
        scale = fp8_scale(tl.max(tl.abs(out), axis=0))
        tl.store(out_ptr + row * stride_out + cols, to_fp8(out, scale), mask=mask)
    else:
        top = tl.zeros([BLOCK], tl.float32)
        for start in range(0, size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < size
            top = tl.maximum(top, tl.abs(_silu_mul_row(gate_up_ptr, row, cols, mask, size, stride_in, gate_up_ptr, 0,
                                                       False)))
        scale = fp8_scale(tl.max(top, axis=0))
        for start in range(0, size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < size
            out = _silu_mul_row(gate_up_ptr, row, cols, mask, size, stride_in, gate_up_ptr, 0, False)
            tl.store(out_ptr + row * stride_out + cols, to_fp8(out, scale), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _silu_and_mul_fp8_rows_kernel(gate_up_ptr, out_ptr, scale_ptr, num_rows, size, stride_in, stride_out,
                                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """_silu_and_mul_fp8_kernel's whole rows from a fixed number of programs: program p takes rows p, p + P, p + 2P,
    ... (P programs), and requests each row's gate and up before it multiplies and quantizes the row before, so that
    a multiprocessor's loads of the next row run under its arithmetic on this one (one program a row leaves the
    memory idle while the row's arithmetic and reductions run: one such program fills an SM's registers). The same
    values as _silu_and_mul_fp8_kernel's."""
    pdl_wait(USE_PDL)
    dtype = gate_up_ptr.dtype.element_ty
    first = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    row_in = gate_up_ptr + first.to(tl.int64) * stride_in + cols
    row_out = out_ptr + first.to(tl.int64) * stride_out + cols
    gate = tl.load(row_in, mask=mask, other=0.0)
    up = tl.load(row_in + size, mask=mask, other=0.0)
    for row in range(first, num_rows, programs):
        row_in += programs.to(tl.int64) * stride_in
        following = cols < tl.where(row + programs < num_rows, size, 0)  # none past the last row
        gate_next = tl.load(row_in, mask=following, other=0.0)
        up_next = tl.load(row_in + size, mask=following, other=0.0)
        out = _silu_mul(gate, up, dtype)
        scale = fp8_scale(tl.max(tl.abs(out), axis=0))
        tl.store(row_out, to_fp8(out, scale), mask=mask)
        tl.store(scale_ptr + row, scale)
        row_out += programs.to(tl.int64) * stride_out
        gate, up = gate_next, up_next


def silu_and_mul_fp8(gate_up: torch.Tensor, pdl: int = 0, chunk: int = SILU_FP8_CHUNK,
                     num_warps: int | None = None, programs: int | None = None) -> Fp8Rows:
    """silu_and_mul whose rows come out quantized to FP8 per token, for an FP8 matmul (Fp8Rows [rows, I]): the
    bytes and scales quantize_fp8 gives for silu_and_mul's rows, without writing those first. chunk (a power of 2)
    and num_warps (None: a warp per 512 features of the chunk, 4 to 16): the kernel's tiles; programs (None: one
    a row): whole rows (up to chunk features) from this many programs, each requesting its next row before it
    computes the current one (benchmarks/activation.py times them)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {gate_up.shape[-1]}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of 2 of at least 16, got {chunk}")
    if programs is not None and programs < 1:
        raise ValueError(f"programs must be at least 1 (or None: one a row), got {programs}")
    size = gate_up.shape[-1] // 2
    if programs is not None and size > chunk:
        raise ValueError(f"programs holds whole rows: gate_up's {size} features a row exceed chunk={chunk}")
    rows = _rows(gate_up)
    out = torch.empty(rows.shape[0], size, dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(rows.shape[0], dtype=FP8_SCALE_DTYPE, device=gate_up.device)
    if rows.shape[0] and size and programs is not None:
        block = triton.next_power_of_2(size)
        _silu_and_mul_fp8_rows_kernel[(min(programs, rows.shape[0]),)](
            rows, out, scale, rows.shape[0], size, rows.stride(0), out.stride(0), BLOCK=block,
            num_warps=num_warps or min(max(block // 512, 4), 16), **launch_options(pdl),
        )
    elif rows.shape[0] and size:
        block = min(triton.next_power_of_2(size), chunk)
        _silu_and_mul_fp8_kernel[(rows.shape[0],)](
            rows, out, scale, size, rows.stride(0), out.stride(0), BLOCK=block,
            num_warps=num_warps or min(max(block // 512, 4), 16),
            **launch_options(pdl),
        )
    return Fp8Rows(out, scale, gate_up.dtype)


def silu_and_mul(gate_up: torch.Tensor, pdl: int = 0, extra: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * I] holding gate then up; returns [..., I] in gate_up's dtype,
    as activation.gated_activation("silu"). extra: float32 of gate_up's shape that gate_up gains first, rounded to
    its dtype (as gate_up.add_(extra) would), in the same pass: LoRA products left to add (models/lora.py)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even (gate then up), got {gate_up.shape[-1]}")
    if extra is not None and (extra.shape != gate_up.shape or extra.dtype != torch.float32 or extra.stride(-1) != 1):
        raise ValueError(f"extra must be float32 [{', '.join(map(str, gate_up.shape))}] with contiguous rows, got "
                         f"{extra.dtype} {list(extra.shape)}")
    size = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    extra_rows = extra.reshape(-1, extra.shape[-1]) if extra is not None else None
    out = torch.empty(*gate_up.shape[:-1], size, dtype=gate_up.dtype, device=gate_up.device)
    out_rows = out.view(-1, size)
    if rows.shape[0] and size:
        block = min(triton.next_power_of_2(size), 1024)
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](
            rows, out_rows, size, rows.stride(0), out_rows.stride(0), BLOCK=block, num_warps=4,
            **launch_options(pdl), extra_ptr=extra_rows,
            stride_extra=extra_rows.stride(0) if extra_rows is not None else 0, HAS_EXTRA=extra is not None,
        )
    return out
