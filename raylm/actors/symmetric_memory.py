"""Collectives through torch symmetric memory (buffers that every GPU of a tensor-parallel group maps over NVLink)
for the small tensors of decode steps: a one-shot all-reduce (kernel_config.symmetric_memory_allreduce) and the
all-reduce fused with the residual add and RMSNorm after it (kernel_config.fused_allreduce_norm). Both are on by
default for tensor parallelism on CUDA (measured faster on 2 x H200, docs/benchmarks.md); false turns either off,
and fused_allreduce_norm=true turns the split of the all-reduce on for CPU runs too (gloo: all-reduce, then add +
norm). Where symmetric memory is unavailable (no NVLink peer access, an older torch) NCCL carries the
all-reduces. Workers that use them see every GPU of the node (ray_executor.py), as the rendezvous needs distinct
device indices."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from raylm.config import KernelConfig
from raylm.kernels.policy import triton_available

logger = logging.getLogger(__name__)


class SymmetricAllReduce:
    """A one-shot all-reduce through symmetric memory, for the small tensors of decode steps: each rank copies
    its input into a buffer that the others map over NVLink, and one kernel per rank sums every rank's copy.
    No NCCL protocol per call, and it can be captured in CUDA graphs. Larger tensors go to NCCL. NVLink multicast
    is not used."""

    MAX_BYTES = 1 << 20

    def __init__(self, group, device: torch.device, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.numel = self.MAX_BYTES // dtype.itemsize
        self.buffer = symm_mem.empty(self.numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self.group_name = group.group_name

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype == self.dtype and tensor.numel() <= self.numel and tensor.is_contiguous()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.view(-1)
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buffer[: flat.numel()], flat, "sum", self.group_name)
        return out.view(tensor.shape)


class SymmetricAllReduceNorm:
    """All-reduce + residual add + RMSNorm in one kernel (kernels/triton_allreduce.py) for up to MAX_ROWS rows of
    `hidden_size`: this rank's exchange buffer and flags (symmetric allocations that every rank of the group
    maps) and its call counter."""

    MAX_ROWS = 128

    def __init__(self, group, device: torch.device, dtype: torch.dtype, hidden_size: int):
        import torch.distributed._symmetric_memory as symm_mem

        world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dtype = dtype
        self.hidden_size = hidden_size
        data = symm_mem.empty(2 * world * self.MAX_ROWS * hidden_size, dtype=dtype, device=device)
        flags = symm_mem.empty(2 * world * self.MAX_ROWS, dtype=torch.int32, device=device)
        flags.zero_()
        torch.cuda.synchronize(device)  # zero before any rank can raise a flag here (rendezvous is collective)
        data_handle = symm_mem.rendezvous(data, group)
        flags_handle = symm_mem.rendezvous(flags, group)
        self._keep = (data, flags, data_handle, flags_handle)

        def addresses(handle, tensor: torch.Tensor) -> torch.Tensor:  # each rank's copy, as this rank maps it
            offset = (tensor.data_ptr() - handle.buffer_ptrs[handle.rank]) // tensor.element_size()
            ptrs = [handle.get_buffer(r, (tensor.numel(),), tensor.dtype, offset).data_ptr() for r in range(world)]
            return torch.tensor(ptrs, dtype=torch.int64, device=device)

        self.buffers = addresses(data_handle, data)
        self.flags = addresses(flags_handle, flags)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)

    def fits(self, partial: torch.Tensor) -> bool:
        return (partial.dim() == 2 and partial.dtype == self.dtype and partial.shape[1] == self.hidden_size
                and 0 < partial.shape[0] <= self.MAX_ROWS and partial.stride(1) == 1)

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 pdl: int = 0):
        from raylm.kernels.triton_allreduce import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(partial, residual.contiguous(), weight, eps, buffers=self.buffers,
                                       flags=self.flags, state=self.state, rank=self.rank, max_rows=self.MAX_ROWS,
                                       pdl=pdl)


def symmetric_all_reduce_requested(config: KernelConfig, device_type: str) -> bool:
    """kernel_config.symmetric_memory_allreduce, null meaning on CUDA."""
    setting = config.symmetric_memory_allreduce
    return device_type == "cuda" if setting is None else setting


def all_reduce_norm_requested(config: KernelConfig, device_type: str) -> bool:
    """kernel_config.fused_allreduce_norm, null meaning on CUDA."""
    setting = config.fused_allreduce_norm
    return device_type == "cuda" if setting is None else setting


def symmetric_memory_requested(config: KernelConfig, device_type: str) -> bool:
    """Whether tensor-parallel workers on `device_type` will ask for symmetric memory (and so must see every GPU
    of the node)."""
    return device_type == "cuda" and (symmetric_all_reduce_requested(config, device_type)
                                      or all_reduce_norm_requested(config, device_type))


def fast_all_reduce(group, device: torch.device, dtype: torch.dtype | None) -> SymmetricAllReduce | None:
    """The symmetric-memory all-reduce on a CUDA device, or None where it is unavailable (NCCL then)."""
    if device.type != "cuda" or dtype is None:
        return None
    try:
        return SymmetricAllReduce(group, device, dtype)
    except Exception as exc:  # not supported here: NCCL carries every all-reduce
        logger.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(exc).__name__, exc)
        return None


def fused_norm(group, device: torch.device, dtype: torch.dtype | None,
                hidden_size: int | None) -> SymmetricAllReduceNorm | None:
    if (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16, torch.float32) or not hidden_size
            or not triton_available()):
        return None
    try:
        return SymmetricAllReduceNorm(group, device, dtype, hidden_size)
    except Exception as exc:  # not supported here: the norms all-reduce first
        logger.warning("fused all-reduce + RMSNorm unavailable (%s: %s)", type(exc).__name__, exc)
        return None
