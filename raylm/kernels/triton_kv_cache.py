"""Writing the step's keys and values into the paged KV cache, in Triton: as they are, or rotated (RoPE) in the
same kernel that also rotates the queries. Caches are [num_blocks, block_size, H_kv, D] per layer; a token's
slot is block_id * block_size + offset, and tokens with a negative slot (padding) are not written.

Decode tokens are rotated and stored by their attention kernel instead (triton_attention.rotary_decode_attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from raylm.kernels.pdl import launch_options, pdl_wait
from raylm.kernels.triton_ops import cos_sin_row, rope_rows, rotate_heads, rotated_rows


def check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Raises ValueError unless `cache` is one layer's [num_blocks, block_size, num_kv_heads, head_dim] cache with
    a contiguous last dimension."""
    if cache.dim() != 4 or cache.shape[2] != num_kv_heads or cache.shape[3] != head_dim:
        raise ValueError(f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {list(cache.shape)}")
    if cache.stride(3) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {cache.stride()}")


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, num_kv_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_block, stride_slot, stride_head,
                     PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr = 0):
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (slot >= 0) & (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    cache_offsets = ((slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot
                     + heads[:, None] * stride_head + dims[None, :])
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Raises ValueError unless k and v [T, H_kv, D] can be stored in the caches at slot_mapping [T]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {list(k.shape)}, got {list(v.shape)}")
    check_cache("k_cache", k_cache, num_kv_heads, head_dim)
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache must have k_cache's shape and strides")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {list(slot_mapping.shape)}")


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, pdl: int = 0) -> None:
    """Stores keys and values [T, H_kv, D] at their cache slots (slot = block_id * block_size + offset).

    Caches are [num_blocks, block_size, H_kv, D], written in place (cast to the cache dtype); tokens whose
    slot is negative are padding and are not written. Both caches must share one layout. `pdl`: the launch's
    trigger mode (kernels/pdl.py).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must be contiguous in their last dimension")
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4, **launch_options(pdl),
    )


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                            slot_mapping_ptr, num_q_heads, num_kv_heads, head_dim,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
                            stride_q_out_t, stride_q_out_h, stride_block, stride_slot, stride_head,
                            PAGE_SIZE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                            BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = 0):
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

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    kv_heads = tl.arange(0, BLOCK_HK)[:, None]
    mask = (kv_heads < num_kv_heads) & dim_mask[None, :]
    key = rotated_rows(k_ptr, token * stride_kt + kv_heads * stride_kh, dims, mask, cos, sin, half)
    mask = mask & (slot >= 0)
    cache_rows = (slot // PAGE_SIZE) * stride_block + (slot % PAGE_SIZE) * stride_slot + kv_heads * stride_head
    tl.store(k_cache_ptr + cache_rows + dims[None, :],
             key.to(k_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + kv_heads * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_rows + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          pdl: int = 0) -> torch.Tensor:
    """triton_ops.rotary_embedding then write_kv_cache in one kernel: returns the rotated queries [T, H_q, D]
    and stores the rotated keys and the values [T, H_kv, D] at their cache slots (negative slots: not stored)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    cos_rows, sin_rows = rope_rows(q, k, cos, sin)
    check_cache_write(k, v, k_cache, v_cache, slot_mapping)
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens:
        _rotary_write_kv_kernel[(num_tokens,)](
            q, k, v, cos_rows, sin_rows, q_out, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads,
            head_dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_rows.stride(0), sin_rows.stride(0), q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            PAGE_SIZE=k_cache.shape[1], BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
            **launch_options(pdl),
        )
    return q_out
