"""Writing the step's keys and values into the paged KV cache, in Triton: as they are, or rotated (RoPE) in the
same kernel that also rotates the queries. Caches are [num_blocks, block_size, H_kv, D] per layer; a token's
slot is block_id * block_size + offset, and tokens with a negative slot (padding) are not written.

Decode tokens are rotated and stored by their attention kernel instead (triton_attention.rotary_decode_attention).

An FP8 cache (float8_e4m3fn) takes each row (one token's key or value of one head) quantized by its own scale,
the row's amax / 448, stored in a float32 scale cache [num_blocks, block_size, H_kv] beside it, as the torch
reference does (kernels/attention.py: write_kv_cache); or, with per-tensor scales (one float32 for a layer's keys,
one for its values: kv_cache_config.fp8_scales), divided by that static scale, nothing stored beside it. The kernels
take the mode as KV_FP8: 0 (no FP8), ROW_SCALES or TENSOR_SCALES.

The value cache has strides of its own in every kernel here and in attention_tiles.py: stored by rows as the keys
are, or transposed within its pages ([num_blocks, H_kv, D, block_size] in memory, seen as a [num_blocks,
block_size, H_kv, D] view with contiguous slots), where the attention's value operand, whose reduction runs along
keys, is contiguous (benchmarks/attention.py times an FP8 cache both ways; the engine stores by rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.fp8 import FP8_DTYPE, FP8_SCALE_DTYPE
from raylm.kernels.pdl import launch_options, pdl_wait
from raylm.kernels.triton_fp8 import fp8_scale, to_fp8
from raylm.kernels.triton_ops import cos_sin_row, rope_rows, rotate_heads, rotated_rows

ROW_SCALES = 1  # KV_FP8: a scale per row (token and head), stored beside the cache
TENSOR_SCALES = 2  # KV_FP8: one static scale for the layer's keys, one for its values


def check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Raises ValueError unless `cache` is one layer's [num_blocks, block_size, num_kv_heads, head_dim] cache with
    a contiguous last dimension."""
    if cache.dim() != 4 or cache.shape[2] != num_kv_heads or cache.shape[3] != head_dim:
        raise ValueError(f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {list(cache.shape)}")
    if cache.stride(3) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {cache.stride()}")


def check_value_cache(v_cache: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raises ValueError unless v_cache has k_cache's shape, stored by rows with k_cache's strides or transposed
    within its pages (contiguous slots)."""
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}")
    if v_cache.stride() != k_cache.stride() and v_cache.stride(1) != 1:
        raise ValueError(f"v_cache must have k_cache's strides {k_cache.stride()} or contiguous slots (transposed "
                         f"within its pages), got strides {v_cache.stride()}")


def value_cache_by_slots(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A value cache of `shape` ([blocks, page, heads, dims]) stored transposed within its pages (in memory
    [blocks, heads, dims, page]). Decode attention on an FP8 cache then loads 16 keys' values of one dimension as
    one 16-byte vector, not byte by byte (attention_tiles.py: 2.58 against 2.07 TB/s on an H200). It is
    zeroed: those runs read the slots past a sequence's end too, with weight 0, and 0 x NaN would be NaN."""
    blocks, page, heads, dims = shape
    return torch.zeros((blocks, heads, dims, page), dtype=dtype, device=device).permute(0, 3, 1, 2)


def scales_by_slots(shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """An FP8 cache's scales of `shape` ([blocks, page, heads]) stored transposed within their pages (in memory
    [blocks, heads, page]): a tile's keys of one head then read their scales 16 at a time (64 bytes) where by rows
    each 4-byte scale takes a 32-byte sector of its own."""
    blocks, page, heads = shape
    return torch.empty((blocks, heads, page), dtype=FP8_SCALE_DTYPE, device=device).permute(0, 2, 1)


def value_strides(v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The kernels' value-cache strides: of a block, a slot, a head and a dimension."""
    return v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3)


@triton.jit
def store_rows(cache_ptr, scale_ptr, rows, cache_offsets, scale_offsets, dims, mask, row_mask, stride_dim,
               KV_FP8: tl.constexpr):
    """Stores [R, D] rows at cache_offsets ([R, 1], each row's start; its elements stride_dim apart) in the cache's
    dtype; into an FP8 cache with ROW_SCALES each row quantized by its own scale (its amax / 448, as kernels/fp8.py's
    quantize_fp8), stored at scale_offsets ([R, 1]) of scale_ptr; with TENSOR_SCALES divided by the one scale at
    scale_ptr (saturating at ±448). mask: the [R, D] elements to store (others must be zero), row_mask: the [R, 1]
    rows."""
    elements = cache_ptr + cache_offsets + dims[None, :] * stride_dim
    if KV_FP8 == 2:  # TENSOR_SCALES
        tl.store(elements, to_fp8(rows.to(tl.float32), tl.load(scale_ptr)), mask=mask)
    elif KV_FP8:
        values = rows.to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(values), axis=1, keep_dims=True))
        tl.store(elements, to_fp8(values, scale), mask=mask)
        tl.store(scale_ptr + scale_offsets, scale, mask=row_mask)
    else:
        tl.store(elements, rows.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
                     num_kv_heads, head_dim, stride_kt, stride_kh, stride_vt, stride_vh, stride_block, stride_slot,
                     stride_head, stride_v_block, stride_v_slot, stride_v_head, stride_v_dim, stride_scale_block,
                     stride_scale_slot, stride_scale_head, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr,
                     KV_FP8: tl.constexpr = False, USE_PDL: tl.constexpr = 0):
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    # The slot as a [1, 1] block rather than a scalar: Triton's interpreter (the CPU tests) cannot mask with a
    # scalar condition broadcast against a block.
    slot = tl.load(slot_mapping_ptr + token + tl.zeros([1, 1], tl.int32)).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)
    row_mask = (slot >= 0) & (heads < num_kv_heads)
    mask = row_mask & (dims[None, :] < head_dim)
    cache_rows = (slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot + heads * stride_head
    value_rows = (slot // PAGE_SIZE) * stride_v_block + (slot % PAGE_SIZE) * stride_v_slot + heads * stride_v_head
    scale_rows = ((slot // PAGE_SIZE) * stride_scale_block + (slot % PAGE_SIZE) * stride_scale_slot
                  + heads * stride_scale_head)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims[None, :], mask=mask, other=0.0)
    store_rows(k_cache_ptr, k_scale_ptr, k, cache_rows, scale_rows, dims, mask, row_mask, 1, KV_FP8)
    store_rows(v_cache_ptr, v_scale_ptr, v, value_rows, scale_rows, dims, mask, row_mask, stride_v_dim, KV_FP8)


def cache_scales(k_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, ...]) -> tuple:
    """The kernels' scale arguments for a cache: (k_scale, v_scale, stride of a block, of a slot, of a head, KV_FP8).
    An FP8 cache needs its (k_scale, v_scale): float32 [num_blocks, block_size, H_kv], both with the same strides
    (contiguous heads, or transposed within pages: scales_by_slots), for ROW_SCALES; one float32 each for
    TENSOR_SCALES. Another cache takes none (its k_cache stands in for them, unused; KV_FP8 0)."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if not fp8:
        if kv_scales:
            raise ValueError(f"kv_scales go with an FP8 cache, got a {k_cache.dtype} one")
        return k_cache, k_cache, 0, 0, 0, 0
    if len(kv_scales) != 2:
        raise ValueError("an FP8 cache needs its (k_scale, v_scale)")
    k_scale, v_scale = kv_scales
    if k_scale.numel() == 1 and v_scale.numel() == 1:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale.dtype != FP8_SCALE_DTYPE:
                raise ValueError(f"a per-tensor {name} must be float32, got {scale.dtype}")
        return k_scale, v_scale, 0, 0, 0, TENSOR_SCALES
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale.shape != k_cache.shape[:3] or scale.dtype != FP8_SCALE_DTYPE:
            raise ValueError(f"{name} must be float32 {list(k_cache.shape[:3])} (a scale per row) or one float32 "
                             f"(per tensor), got {scale.dtype} {list(scale.shape)}")
    if v_scale.stride() != k_scale.stride():
        raise ValueError("v_scale must have k_scale's strides")
    return k_scale, v_scale, *k_scale.stride(), ROW_SCALES


def check_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Raises ValueError unless k and v [T, H_kv, D] can be stored in the caches at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(v.shape)}")
    check_cache("k_cache", k_cache, num_kv_heads, head_dim)
    check_value_cache(v_cache, k_cache)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {list(slot_mapping.shape)}")


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, pdl: int = 0, kv_scales: tuple[torch.Tensor, ...] = ()) -> None:
    """Stores keys and values [T, H_kv, D] at their cache slots (slot = block_id * block_size + offset).

    Caches are [num_blocks, block_size, H_kv, D], written in place (cast to the cache dtype; an FP8 cache's rows
    quantized, their scales into kv_scales); tokens whose slot is negative are padding and are not written. The
    value cache may be stored by rows or transposed within its pages. `pdl`: the launch's trigger mode
    (kernels/pdl.py).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head, fp8 = cache_scales(k_cache, kv_scales)
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous in their last dimension")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *value_strides(v_cache), stride_scale_block, stride_scale_slot, stride_scale_head,
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=fp8, num_warps=4, **launch_options(pdl),
    )


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                            v_scale_ptr, slot_mapping_ptr, num_q_heads, num_kv_heads, head_dim,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
                            stride_q_out_t, stride_q_out_h, stride_block, stride_slot, stride_head,
                            stride_v_block, stride_v_slot, stride_v_head, stride_v_dim, stride_scale_block,
                            stride_scale_slot, stride_scale_head, PAGE_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr,
                            BLOCK_HK: tl.constexpr,
                            BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr = False, USE_PDL: tl.constexpr = 0):
    """One token: rotates its query heads into q_out, and its key heads (rotated) and value heads into its
    cache slot (none for a negative slot). Keys are rounded to k's dtype before the cache's, as rotating then
    writing them rounds them."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    half = head_dim // 2
    cos, sin = cos_sin_row(cos_ptr, sin_ptr, token, stride_cos, stride_sin, dims, dim_mask)
    rotate_heads(q_ptr, q_out_ptr, token, cos, sin, num_q_heads, half, dims, dim_mask, stride_qt, stride_qh,
                 stride_q_out_t, stride_q_out_h, BLOCK_HQ)

    slot = tl.load(slot_mapping_ptr + token + tl.zeros([1, 1], tl.int32)).to(tl.int64)  # as _write_kv_kernel's
    kv_heads = tl.arange(0, BLOCK_HK)[:, None]
    mask = (kv_heads < num_kv_heads) & dim_mask[None, :]
    key = rotated_rows(k_ptr, token * stride_kt + kv_heads * stride_kh, dims, mask, cos, sin, half)
    row_mask = (kv_heads < num_kv_heads) & (slot >= 0)
    mask = mask & (slot >= 0)
    cache_rows = (slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot + kv_heads * stride_head
    value_rows = (slot // PAGE_SIZE) * stride_v_block + (slot % PAGE_SIZE) * stride_v_slot + kv_heads * stride_v_head
    scale_rows = ((slot // PAGE_SIZE) * stride_scale_block + (slot % PAGE_SIZE) * stride_scale_slot
                  + kv_heads * stride_scale_head)
    store_rows(k_cache_ptr, k_scale_ptr, key.to(k_ptr.dtype.element_ty), cache_rows, scale_rows, dims, mask,
               row_mask, 1, KV_FP8)
    v = tl.load(v_ptr + token * stride_vt + kv_heads * stride_vh + dims[None, :], mask=mask, other=0.0)
    store_rows(v_cache_ptr, v_scale_ptr, v, value_rows, scale_rows, dims, mask, row_mask, stride_v_dim, KV_FP8)


def rotary_write_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          pdl: int = 0, kv_scales: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """triton_ops.rotary_embedding then write_kv_cache in one kernel: returns the rotated queries [T, H_q, D]
    and stores the rotated keys and the values [T, H_kv, D] at their cache slots (negative slots: not stored;
    an FP8 cache's rows quantized, their scales into kv_scales)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cos_rows, sin_rows = rope_rows(q, k, cos, sin)
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    k_scale, v_scale, stride_scale_block, stride_scale_slot, stride_scale_head, fp8 = cache_scales(k_cache, kv_scales)
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens:
        _rotary_write_kv_kernel[(num_tokens,)](
            q, k, v, cos_rows, sin_rows, q_out, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_q_heads,
            num_kv_heads, head_dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_rows.stride(0), sin_rows.stride(0), q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *value_strides(v_cache), stride_scale_block,
            stride_scale_slot, stride_scale_head, PAGE_SIZE=k_cache.shape[1],
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=fp8,
            num_warps=4, **launch_options(pdl),
        )
    return q_out
