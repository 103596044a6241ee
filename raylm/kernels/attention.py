"""Paged attention, torch reference backend.

Tokens of a step are flattened: first the decode sequences (one query token each), then the prefill
chunks. New keys and values are written into the paged cache at their slots; attention then reads
each sequence's whole context back from the cache through precomputed slot indices. The metadata is
built once per step and shared by every layer.

An FP8 cache (kv_cache_config.dtype='fp8') stores each token's key and value of each head in float8_e4m3fn
with a float32 scale (the row's amax / 448, kernels/fp8.py) in tensors of their own, [num_blocks, block_size,
H_kv]: a scale per row needs no calibration and follows every outlier token. Attention reads them back
dequantized, the chunk's own new keys and values included, so a token attends to what the cache holds whether
it was written this step or earlier. With per-tensor scales (kv_cache_config.fp8_scales='per_tensor') the scale
tensors hold one float32 each, a layer's static scale for its keys and one for its values: rows are divided by it
(saturating at ±448) and nothing is stored beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from raylm.kernels.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8, quantize_fp8_by
from raylm.kernels.policy import KernelPolicy
from raylm.kernels.rotary import apply_rotary


@dataclass
class PrefillChunk:
    """One sequence's chunk of query tokens over its cached prefix."""

    query_start: int
    query_len: int
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when the chunk is its whole context
    mask: torch.Tensor | None  # [1, 1, query_len, context_len] bool; None means plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of every new token
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] cache slots, padded
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillChunk] = field(default_factory=list)
    adds_qkv_products = False  # attend takes no LoRA products to add (TritonAttentionMetadata's do)

    def attend(self, q, k, v, k_cache, v_cache, scale: float,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               kernels: KernelPolicy = KernelPolicy(), kv_scales: tuple[torch.Tensor, torch.Tensor] = ()
               ) -> torch.Tensor:
        """Attention of q over the cache after storing k and v; with rope = (cos, sin), q and k rotated first
        (by the kernel the policy `kernels` chooses). kv_scales: an FP8 cache's (k_scale, v_scale)."""
        if rope is not None:
            q, k = apply_rotary(q, k, rope, kernels)
        return paged_attention(q, k, v, k_cache, v_cache, self, scale, kv_scales)


def context_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..context_len-1 for block tables of shape [..., num_blocks]."""
    positions = torch.arange(context_len, device=block_table.device)
    return block_table[..., positions // block_size] * block_size + positions % block_size


def padded_block_table(block_lists: list[list[int]], dtype: type = np.int64) -> np.ndarray:
    """Block tables as one [sequences, longest] array, short rows padded with the null block 0."""
    width = max(len(blocks) for blocks in block_lists)
    table = np.zeros((len(block_lists), width), dtype=dtype)
    for row, blocks in enumerate(block_lists):
        table[row, : len(blocks)] = blocks
    return table


def build_metadata(
    decode_contexts: list[tuple[list[int], int]],
    prefill_chunks: list[tuple[list[int], int, int]],
    slot_mapping: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """Builds the metadata of a step.

    decode_contexts: (block_ids, context_len) per decode sequence, in token order.
    prefill_chunks: (block_ids, start_position, query_len) per prefill chunk, in token order.
    """
    meta = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device))
    if decode_contexts:
        max_context = max(length for _, length in decode_contexts)
        table = torch.from_numpy(padded_block_table([blocks for blocks, _ in decode_contexts])).to(device)
        lengths = torch.tensor([length for _, length in decode_contexts], device=device)
        key_pos = torch.arange(max_context, device=device)
        mask = key_pos[None, :] < lengths[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (lengths[:, None] - 1 - sliding_window)
        meta.num_decode_tokens = len(decode_contexts)
        # Padded positions read slot 0 of the null block, which stays zero, so masked values are finite.
        meta.decode_slots = context_slots(table, max_context, block_size).masked_fill(~mask, 0)
        meta.decode_mask = mask[:, None, None, :]
    query_start = meta.num_decode_tokens
    for blocks, start, query_len in prefill_chunks:
        context_len = start + query_len
        windowed = sliding_window is not None and context_len > sliding_window
        if start == 0 and not windowed:
            meta.prefills.append(PrefillChunk(query_start, query_len, None, None))
        else:
            table = torch.tensor(blocks, dtype=torch.long, device=device)
            slots = context_slots(table, context_len, block_size)
            query_pos = torch.arange(start, context_len, device=device)[:, None]
            key_pos = torch.arange(context_len, device=device)[None, :]
            mask = key_pos <= query_pos
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
            meta.prefills.append(PrefillChunk(query_start, query_len, slots, mask[None, None]))
        query_start += query_len
    return meta


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] = (),
) -> None:
    """Stores new keys and values ([T, H_kv, D]) at their slots of the paged cache; into an FP8 cache quantized
    per token and head, their scales into kv_scales, or by the per-tensor scales kv_scales hold."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for new, cache, scales in zip((k, v), (k_cache, v_cache), kv_scales or (None, None)):
        rows = cache.view(-1, num_kv_heads, head_dim)
        if cache.dtype == FP8_DTYPE:
            if scales.numel() == 1:  # per tensor
                new = quantize_fp8_by(new, scales)
            else:
                new, scale = quantize_fp8(new)
                scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)
            # index_copy_ has no float8 kernel on the CPU: the bytes are copied instead.
            rows, new = rows.view(torch.uint8), new.view(torch.uint8)
        rows.index_copy_(0, slot_mapping, new)


def read_kv_cache(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows at `slots` (any shape) as [*slots.shape, H_kv, D] in `dtype`; an FP8 cache's dequantized
    by their scales."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, slots.reshape(-1))
    if scales is not None and scales.numel() == 1:
        rows = dequantize_fp8(rows, scales.view(1, 1))
    elif scales is not None:
        rows = dequantize_fp8(rows, scales.view(-1, num_kv_heads).index_select(0, slots.reshape(-1)))
    return rows.to(dtype).view(*slots.shape, num_kv_heads, head_dim)


def fake_quantize_kv(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Keys or values [T, H_kv, D] as an FP8 cache with scales like `scale` gives them back: quantized per token and
    head (or by the one per-tensor scale), dequantized."""
    if scale.numel() == 1:
        return dequantize_fp8(quantize_fp8_by(values, scale), scale.view(1, 1)).to(values.dtype)
    return dequantize_fp8(*quantize_fp8(values)).to(values.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] = (),
) -> torch.Tensor:
    """q: [T, H_q, D]; k, v: [T, H_kv, D]; caches: [num_blocks, block_size, H_kv, D] (and an FP8 cache's
    kv_scales: [num_blocks, block_size, H_kv]). Returns [T, H_q, D]."""
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
    k_scale, v_scale = kv_scales or (None, None)
    if kv_scales and any(chunk.context_slots is None for chunk in meta.prefills):
        # Chunks that attend to their own keys and values alone take them from k and v: as the cache holds them.
        k, v = fake_quantize_kv(k, k_scale), fake_quantize_kv(v, v_scale)
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        slots = meta.decode_slots
        # index_select gathers far faster than advanced indexing on the CPU.
        keys = read_kv_cache(k_cache, k_scale, slots, q.dtype).transpose(1, 2)  # [B, H_kv, L, D]
        values = read_kv_cache(v_cache, v_scale, slots, q.dtype).transpose(1, 2)
        query = q[:num_decodes].unsqueeze(2)  # [B, H_q, 1, D]
        attn = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:num_decodes] = attn.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H_q, Lq, D]
        if chunk.context_slots is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            keys = read_kv_cache(k_cache, k_scale, chunk.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)
            values = read_kv_cache(v_cache, v_scale, chunk.context_slots, q.dtype).transpose(0, 1).unsqueeze(0)
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=chunk.mask, scale=scale, enable_gqa=True
            )
        out[rows] = attn.squeeze(0).transpose(0, 1)
    return out
