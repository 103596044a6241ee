"""Attention through FlashInfer (attention_backend="flashinfer"), where the flashinfer package is importable:
its batch decode and batch prefill kernels over raylm's paged cache, which already has FlashInfer's "NHD" layout
(per layer, keys and values each [blocks, block_size, kv_heads, head_dim]; a block is a FlashInfer page).

FlashInfer plans a batch on the host (how to split the work, each request's offsets) and its kernels read the
plan from device buffers; one plan per step serves every layer. New keys and values go into the cache through
raylm's Triton kernel (rotated in the same kernel, as on the Triton path); FlashInfer then attends, decode
sequences with the decode kernel, prefill chunks over their cached prefix with the causal prefill kernel
(a chunk's queries are the last positions of its context, FlashInfer's alignment of a causal mask).

Steps overlap: step N+1 is planned while the GPU may not have started step N yet, and a plan's copies to the
device read host buffers that the next plan of the same wrapper rewrites. So plans rotate over PLAN_SETS sets
of wrappers: a set is planned again only two steps later, after the engine has waited for the step that used
it. All sets share one float workspace: kernels of successive steps run in stream order.

Decode steps of a captured batch size replay a CUDA graph (FlashInferDecodeGraphs): a decode wrapper per size in
FlashInfer's CUDA-graph mode keeps its page arrays in fixed device buffers, and is planned again before each
replay; other steps run eagerly on the rotating wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raylm.kernels.policy import KernelPolicy

PLAN_SETS = 3
WORKSPACE_BYTES = 256 * 1024 * 1024


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def paged_kv_arrays(contexts: list[tuple[list[int], int]], block_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's page description of sequences given as (block ids, context length): indptr [S + 1] (each
    sequence's first entry in indices), indices (the blocks holding the context, in order) and last_page_len
    [S] (tokens in each sequence's last block), all int32. Blocks past the context are left out."""
    pages = [-(-length // block_size) for _, length in contexts]
    for (blocks, length), count in zip(contexts, pages):
        if length < 1 or count > len(blocks):
            raise ValueError(f"a context of {length} tokens needs {count} blocks of {block_size}, got {len(blocks)}")
    indptr = np.zeros(len(contexts) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    indices = np.fromiter((block for (blocks, _), count in zip(contexts, pages) for block in blocks[:count]),
                          dtype=np.int32, count=int(indptr[-1]))
    last_page_len = np.asarray([length - (count - 1) * block_size for (_, length), count in zip(contexts, pages)],
                               dtype=np.int32)
    return indptr, indices, last_page_len


@dataclass
class FlashInferAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64; negative slots are not written (padding)
    scale: float
    num_decodes: int = 0
    decode: Any = None  # a planned BatchDecodeWithPagedKVCacheWrapper, for the first num_decodes tokens
    prefill: Any = None  # a planned BatchPrefillWithPagedKVCacheWrapper, for the tokens after them
    adds_qkv_products = False  # attend takes no LoRA products to add (TritonAttentionMetadata's do)

    def attend(self, q, k, v, k_cache, v_cache, scale: float,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               kernels: KernelPolicy = KernelPolicy()) -> torch.Tensor:
        """Attention of q over the cache after storing k and v at their slots; with rope = (cos, sin), q and k
        are rotated first, in the same (Triton) kernel that stores them, launched as the kernel policy says."""
        from raylm.kernels.triton_kv_cache import rotary_write_kv_cache, write_kv_cache

        if scale != self.scale:
            raise ValueError(f"this step was planned for softmax scale {self.scale}, the layer uses {scale}")
        if rope is None:
            write_kv_cache(k, v, k_cache, v_cache, self.slot_mapping, kernels.pdl)
        else:
            q = rotary_write_kv_cache(q, k, v, rope[0], rope[1], k_cache, v_cache, self.slot_mapping, kernels.pdl)
        cache = (k_cache, v_cache)
        if self.prefill is None:
            return self.decode.run(q, cache)
        if self.decode is None:
            return self.prefill.run(q, cache)
        out = torch.empty_like(q)
        out[: self.num_decodes] = self.decode.run(q[: self.num_decodes], cache)
        out[self.num_decodes :] = self.prefill.run(q[self.num_decodes :], cache)
        return out


class FlashInferPlanner:
    """The FlashInfer backend's build_metadata: plans each step on the next set of wrappers."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 device: torch.device):
        import flashinfer

        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend='flashinfer' takes float16 or bfloat16, got {dtype}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.dtype = dtype
        # FlashInfer asks for a workspace that is zero at its first use.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Grouped-query heads (4 or more queries per KV head) decode faster on the tensor-core kernels.
        self.tensor_cores = num_qo_heads // num_kv_heads >= 4
        self.sets = [(flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    use_tensor_cores=self.tensor_cores),
                      flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD"))
                     for _ in range(PLAN_SETS)]
        self.steps = 0

    def options(self, sliding_window: int | None) -> dict:
        """The keywords of every plan: window, softmax scale, dtypes."""
        return dict(window_left=sliding_window - 1 if sliding_window else -1, sm_scale=self.scale,
                    q_data_type=self.dtype, kv_data_type=self.dtype)

    def __call__(self, decode_contexts: list[tuple[list[int], int]],
                 prefill_chunks: list[tuple[list[int], int, int]], slot_mapping: list[int], block_size: int,
                 sliding_window: int | None, device: torch.device) -> FlashInferAttentionMetadata:
        """The same inputs as attention.build_metadata; plans the step's FlashInfer kernels."""
        decode, prefill = self.sets[self.steps % PLAN_SETS]
        self.steps += 1
        common = self.options(sliding_window)
        meta = FlashInferAttentionMetadata(
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device, non_blocking=True),
            scale=self.scale, num_decodes=len(decode_contexts))
        if decode_contexts:
            indptr, indices, last_page_len = map(torch.from_numpy, paged_kv_arrays(decode_contexts, block_size))
            decode.plan(indptr, indices, last_page_len, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                        block_size, **common)
            meta.decode = decode
        if prefill_chunks:
            contexts = [(blocks, start + length) for blocks, start, length in prefill_chunks]
            indptr, indices, last_page_len = map(torch.from_numpy, paged_kv_arrays(contexts, block_size))
            lengths = np.asarray([length for _, _, length in prefill_chunks], dtype=np.int32)
            qo_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            prefill.plan(qo_indptr, indptr, indices, last_page_len, self.num_qo_heads, self.num_kv_heads,
                         self.head_dim, block_size, causal=True, **common)
            meta.prefill = prefill
        return meta


class FlashInferDecodeGraphs:
    """The FlashInfer side of the decode CUDA graphs (engine/cuda_graphs.py): one decode wrapper per captured
    batch size in FlashInfer's CUDA-graph mode, whose page arrays live in device buffers shared by all sizes
    (a replay reads them; a plan rewrites them by copies queued behind the step before). Padding rows attend to
    one key of the null block.

    A plan also stages its work split in the wrapper's pinned host buffer and queues a copy from it; the next
    plan of the same wrapper first waits for that copy (an event recorded after the plan), which has normally
    long finished, since the engine runs at most one step ahead.
    """

    def __init__(self, planner: FlashInferPlanner, batch_sizes: list[int], max_blocks: int, block_size: int,
                 sliding_window: int | None, device: torch.device):
        import flashinfer

        self.planner = planner
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        max_batch = max(batch_sizes)
        self.indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_batch * max_blocks, dtype=torch.int32, device=device)
        self.last_page_len = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.wrappers = {
            batch: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                planner.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=planner.tensor_cores,
                paged_kv_indptr_buffer=self.indptr[: batch + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_page_len[:batch], backend="fa2")
            for batch in batch_sizes}
        self.planned: dict[int, torch.cuda.Event] = {}

    def metadata(self, batch: int, slot_mapping: torch.Tensor) -> FlashInferAttentionMetadata:
        """The attention metadata a graph of `batch` rows is captured with (slot_mapping: the graph's buffer)."""
        return FlashInferAttentionMetadata(slot_mapping=slot_mapping, scale=self.planner.scale, num_decodes=batch,
                                           decode=self.wrappers[batch])

    def plan(self, batch: int, contexts: list[tuple[list[int], int]]) -> None:
        """Plans the wrapper of `batch` rows for these (block ids, context length) decodes, padded to the batch."""
        padded = contexts + [([0], 1)] * (batch - len(contexts))
        indptr, indices, last_page_len = paged_kv_arrays(padded, self.block_size)
        previous = self.planned.get(batch)
        if previous is not None:
            previous.synchronize()
        # Indices go to the device first: FlashInfer copies host indices into its buffer synchronously.
        device_indices = torch.from_numpy(indices).to(self.device, non_blocking=True)
        self.wrappers[batch].plan(torch.from_numpy(indptr), device_indices, torch.from_numpy(last_page_len),
                                  self.planner.num_qo_heads, self.planner.num_kv_heads, self.planner.head_dim,
                                  self.block_size, **self.planner.options(self.sliding_window))
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.planned[batch] = event
