"""Attention metadata for the Triton kernels: block tables, lengths and offsets as device tensors.

The same metadata object serves a CUDA-graph replay: its tensors can be static buffers that the runner
refills in place before each replay (see engine/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.kernels.attention import padded_block_table
from raylm.kernels.policy import KernelPolicy


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64; negative slots are not written (padding)
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [B] int32
    prefill_block_tables: torch.Tensor | None = None  # [S, max_blocks] int32
    query_start_loc: torch.Tensor | None = None  # [S + 1] int32, offsets within the prefill tokens
    seq_starts: torch.Tensor | None = None  # [S] int32
    prefill_context_lens: torch.Tensor | None = None  # [S] int32
    sliding_window: int | None = None
    # Decode rows may hold several consecutive positions of one sequence (speculative decoding's verify rows): every
    # row's key and value is stored before any row attends, instead of by each row's own attention kernel.
    decode_write_first: bool = False

    @property
    def adds_qkv_products(self) -> bool:
        """Whether attend takes a LoRA qkv layer's products unadded (qkv_addends): a step of decodes alone, each
        rotated and stored by its own attention kernel, which adds them as it loads q, k and v."""
        return self.num_decodes > 0 and self.prefill_block_tables is None and not self.decode_write_first

    def attend(self, q, k, v, k_cache, v_cache, scale: float,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               kernels: KernelPolicy = KernelPolicy(), kv_scales: tuple[torch.Tensor, ...] = (),
               qkv_addends: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Attention of q over the cache after storing k and v at their slots; with rope = (cos, sin), q and k
        are rotated first, in the kernel that stores them: for decode tokens, their attention kernel. The
        kernels launch with the policy's PDL trigger mode (kernels/pdl.py). kv_scales: an FP8 cache's (k_scale,
        v_scale). qkv_addends: float32 products to add to q, k and v first, where adds_qkv_products."""
        if qkv_addends is not None and not (rope is not None and self.adds_qkv_products):
            raise ValueError("qkv_addends need a step of decodes alone, rotated by their attention kernel")
        pdl = kernels.pdl
        fp8 = {"kv_scales": kv_scales} if kv_scales else {}
        # FP8 products (kernel_config.fp8_attention) need the values by slots, as the engine stores an FP8 cache's,
        # and heads of 32 dimensions or more (the FP8 MMA's reduction); smaller heads widen their tiles.
        fp8_dot = kv_scales and kernels.fp8_attention_dot and q.shape[-1] >= 32
        if fp8_dot:
            decode_fp8 = {**fp8, "fp8_dot": True}
        elif kv_scales and kernels.fp8_attention_slices:  # tiles in slices of keys a warp (values by slots)
            decode_fp8 = {**fp8, "warp_split": True}
        elif kv_scales and kernels.fp8_attention_keys_first:  # the keys and values first (values by slots)
            decode_fp8 = {**fp8, "keys_first": True}
        else:
            decode_fp8 = fp8
        from raylm.kernels.triton_attention import paged_decode_attention, rotary_decode_attention
        from raylm.kernels.triton_kv_cache import rotary_write_kv_cache, write_kv_cache
        from raylm.kernels.triton_prefill_attention import paged_prefill_attention

        decodes = self.num_decodes
        prefill_queries = q[decodes:]
        if rope is None:
            write_kv_cache(k, v, k_cache, v_cache, self.slot_mapping, pdl, **fp8)
        elif self.prefill_block_tables is not None:  # decode tokens are rotated and stored by their attention
            tail = slice(decodes, None)
            prefill_queries = rotary_write_kv_cache(q[tail], k[tail], v[tail], rope[0][tail], rope[1][tail], k_cache,
                                                    v_cache, self.slot_mapping[tail], pdl, **fp8)
        if decodes:
            head = slice(0, decodes)
            if rope is not None and self.decode_write_first:
                queries = rotary_write_kv_cache(q[head], k[head], v[head], rope[0][head], rope[1][head], k_cache,
                                                v_cache, self.slot_mapping[head], pdl, **fp8)
                decoded = paged_decode_attention(queries, k_cache, v_cache, self.decode_block_tables,
                                                 self.decode_context_lens, scale, self.sliding_window, pdl=pdl,
                                                 **decode_fp8)
            elif rope is None:
                decoded = paged_decode_attention(q[head], k_cache, v_cache, self.decode_block_tables,
                                                 self.decode_context_lens, scale, self.sliding_window, pdl=pdl,
                                                 **decode_fp8)
            else:
                decoded = rotary_decode_attention(q[head], k[head], v[head], rope[0][head], rope[1][head], k_cache,
                                                  v_cache, self.slot_mapping[head], self.decode_block_tables,
                                                  self.decode_context_lens, scale, self.sliding_window, pdl=pdl,
                                                  addends=qkv_addends, **decode_fp8)
            if self.prefill_block_tables is None:
                return decoded
        prefilled = paged_prefill_attention(prefill_queries, k_cache, v_cache, self.prefill_block_tables,
                                            self.query_start_loc, self.seq_starts, self.prefill_context_lens, scale,
                                            self.sliding_window, **fp8)
        return torch.cat([decoded, prefilled]) if decodes else prefilled


def build_triton_metadata(
    decode_contexts: list[tuple[list[int], int]],
    prefill_chunks: list[tuple[list[int], int, int]],
    slot_mapping: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> TritonAttentionMetadata:
    """The same inputs as attention.build_metadata, laid out for the Triton kernels."""

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    meta = TritonAttentionMetadata(slot_mapping=to_device(np.asarray(slot_mapping, dtype=np.int64)),
                                   sliding_window=sliding_window)
    if decode_contexts:
        meta.num_decodes = len(decode_contexts)
        meta.decode_block_tables = to_device(padded_block_table([blocks for blocks, _ in decode_contexts], np.int32))
        meta.decode_context_lens = to_device(np.asarray([length for _, length in decode_contexts], dtype=np.int32))
    if prefill_chunks:
        starts = np.asarray([start for _, start, _ in prefill_chunks], dtype=np.int32)
        lengths = np.asarray([length for _, _, length in prefill_chunks], dtype=np.int32)
        meta.prefill_block_tables = to_device(padded_block_table([blocks for blocks, _, _ in prefill_chunks], np.int32))
        meta.query_start_loc = to_device(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        meta.seq_starts = to_device(starts)
        meta.prefill_context_lens = to_device(starts + lengths)
    return meta
