"""Tensor-parallel building blocks: linears and embeddings that hold one rank's shard.

With a tensor-parallel size of 1 each layer is a plain dense layer. Every parameter carries a
`weight_loader(param, loaded, shard_id)` that copies this rank's slice of a full checkpoint tensor,
so a loader reads checkpoints without knowing how layers are split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raylm.kernels import fp8 as fp8_kernels
from raylm.kernels.fp8 import FP8_DTYPE, Fp8Rows
from raylm.kernels.linear import linear
from raylm.kernels.policy import KernelPolicy


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits: its tensor-parallel group, pipeline stage, and expert-parallel split."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object | None = None
    pp_rank: int = 0
    pp_size: int = 1
    ep_size: int = 1
    # A faster all-reduce for small tensors (actors/symmetric_memory.py: SymmetricAllReduce), or None: NCCL / gloo
    # throughout.
    fast_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Whether the o / down projections leave their all-reduce to the RMSNorm after them (Unreduced), and the
    # kernel that then does all-reduce + residual add + RMSNorm in one (actors/symmetric_memory.py:
    # SymmetricAllReduceNorm; None: the norm all-reduces first). Set at TP > 1 on GPUs
    # (kernel_config.fused_allreduce_norm).
    defer_reduce: bool = False
    fused_norm: Callable | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The layers of this pipeline stage: an even split, earlier stages taking the remainder."""
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size ({self.pp_size}) exceeds the model's layers ({num_layers})")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return start, start + base + (1 if self.pp_rank < extra else 0)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the tensor-parallel group (use the returned tensor: it may be a new one)."""
        if self.tp_size > 1:
            fast = self.fast_all_reduce
            if fast is not None and fast.fits(tensor):
                return fast(tensor)
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelContext()


@dataclass(frozen=True)
class Unreduced:
    """A row-parallel layer's output before its all-reduce: the RMSNorm after it reduces it (fused with the
    residual add and the norm where ctx.fused_norm takes it), and anything else calls reduce()."""

    partial: torch.Tensor
    ctx: ParallelContext

    def reduce(self) -> torch.Tensor:
        return self.ctx.all_reduce(self.partial)


def _shard(size: int, ctx: ParallelContext, what: str) -> int:
    if size % ctx.tp_size:
        raise ValueError(f"{what} ({size}) must be divisible by tensor_parallel_size ({ctx.tp_size})")
    return size // ctx.tp_size


def _set_loader(param: nn.Parameter, loader: Callable) -> nn.Parameter:
    param.weight_loader = loader
    return param


def _weight(rows: int, columns: int, fp8: bool, loader: Callable) -> nn.Parameter:
    """A linear layer's weight: in the default dtype, or float8_e4m3fn (fp8), which has no gradient."""
    return _set_loader(nn.Parameter(torch.empty(rows, columns, dtype=FP8_DTYPE if fp8 else None),
                                    requires_grad=not fp8), loader)


def _weight_scale(rows: int, fp8: bool, loader: Callable) -> nn.Parameter | None:
    """An FP8 weight's float32 scale per output row (None without fp8). A column-parallel layer's loader splits it
    as it splits rows; a row-parallel layer's rows are whole on every rank, and so are its scales."""
    if not fp8:
        return None
    return _set_loader(nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False), loader)


def copy_whole(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Copies a checkpoint tensor into a parameter unsplit (a per-tensor scale broadcast over its rows)."""
    param.data.copy_(loaded[...])


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded[...] if not isinstance(loaded, torch.Tensor) else loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the output stays sharded."""

    kernels = KernelPolicy()  # the model's kernel policy (kernels/policy.py: set_kernel_policy)

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext = SINGLE,
                 fp8: bool = False):
        super().__init__()
        self.ctx = ctx
        self.out_per_rank = _shard(out_features, ctx, "output features")
        self.weight = _weight(self.out_per_rank, in_features, fp8, self._load)
        self.weight_scale = _weight_scale(self.out_per_rank, fp8, self._load)
        self.bias = _set_loader(nn.Parameter(torch.empty(self.out_per_rank)), self._load) if bias else None
        self.lora: nn.Module | None = None  # adapter slots (models/lora.py), on engines serving LoRA adapters

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        start = self.ctx.tp_rank * param.shape[0]
        param.data.copy_(loaded.narrow(0, start, param.shape[0]))

    def forward(self, x: torch.Tensor | Fp8Rows, defer_add: bool = False) -> torch.Tensor:
        """defer_add: LoRA products computed beside the GEMV may come back unadded (models/lora.py's
        PendingProducts), for the kernel after the layer to add (the SiLU-mul after gate / up)."""
        if self.lora is not None:
            return self.lora.linear(x, self.weight, self.bias, self.weight_scale, defer_add=defer_add)
        return linear(x, self.weight, self.bias, self.kernels, self.weight_scale)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer takes x as FP8 rows quantized before it (_takes_fp8_rows): the norm before it may
        hand them over (kernels/norm.py)."""
        return _takes_fp8_rows(self, x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate and up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, ctx: ParallelContext = SINGLE,
                 fp8: bool = False):
        super().__init__(in_features, sum(out_sizes), bias, ctx, fp8)
        self.shard_sizes = [_shard(size, ctx, "output features") for size in out_sizes]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection needs the shard index of the checkpoint tensor")
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.ctx.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one matmul, heads split across ranks.

    When there are fewer KV heads than ranks, each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: ParallelContext = SINGLE,
        fp8: bool = False,
    ):
        self.head_dim = head_dim
        self.num_heads = _shard(num_heads, ctx, "attention heads")
        if num_kv_heads >= ctx.tp_size:
            self.num_kv_heads = _shard(num_kv_heads, ctx, "key/value heads")
            self.kv_replicas = 1
        else:
            if ctx.tp_size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({ctx.tp_size}) must be a multiple of the key/value heads "
                    f"({num_kv_heads}) when it exceeds them"
                )
            self.num_kv_heads = 1
            self.kv_replicas = ctx.tp_size // num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * ctx.tp_size
        super().__init__(hidden_size, total, bias, ctx, fp8)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id == "q":
            offset, size, rank_index = 0, self.q_size, self.ctx.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank_index = self.kv_size, self.ctx.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKV shard must be 'q', 'k' or 'v', got {shard_id!r}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank_index * size, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


def _takes_fp8_rows(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether `layer` would quantize x to FP8 rows for its matmul (FP8 weights, no LoRA adapters: through
    torch._scaled_mm, or through a decode GEMV that takes FP8 rows), so that the kernel producing x may write
    them instead (kernels/fp8.py's Fp8Rows)."""
    if layer.weight_scale is None or layer.lora is not None or not layer.kernels.on_triton(x):
        return False
    if layer.kernels.gemv_applies(x, layer.weight):
        return layer.kernels.gemv_takes_fp8_rows
    return fp8_kernels.scaled_mm_applies(x, layer.weight)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced across ranks."""

    kernels = KernelPolicy()  # the model's kernel policy (kernels/policy.py: set_kernel_policy)

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext = SINGLE,
                 fp8: bool = False):
        super().__init__()
        self.ctx = ctx
        self.in_per_rank = _shard(in_features, ctx, "input features")
        self.weight = _weight(out_features, self.in_per_rank, fp8, self._load)
        self.weight_scale = _weight_scale(out_features, fp8, copy_whole)
        self.bias = _set_loader(nn.Parameter(torch.empty(out_features)), default_weight_loader) if bias else None
        # Adapter slots (models/lora.py), on engines serving LoRA adapters: their products are partial sums too.
        self.lora: nn.Module | None = None

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        start = self.ctx.tp_rank * param.shape[1]
        param.data.copy_(loaded.narrow(1, start, param.shape[1]))

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer takes x as FP8 rows quantized before it (_takes_fp8_rows): the SiLU-and-mul before it
        may hand them over (models/llama.py's MLP)."""
        return _takes_fp8_rows(self, x)

    def forward(self, x: torch.Tensor | Fp8Rows, defer_reduce: bool = False) -> torch.Tensor | Unreduced:
        """With defer_reduce (and no bias), the partial sum as Unreduced: the next RMSNorm all-reduces it. On one
        rank without bias, the LoRA products computed beside the GEMV may come back unadded (PendingProducts), for
        that RMSNorm to add."""
        if self.lora is not None:
            out = self.lora.linear(x, self.weight, None, self.weight_scale,
                                   defer_add=self.ctx.tp_size == 1 and self.bias is None)
            if hasattr(out, "products"):
                return out
        else:
            out = linear(x, self.weight, None, self.kernels, self.weight_scale)
        if defer_reduce and self.bias is None:
            return Unreduced(out, self.ctx)
        out = self.ctx.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split into contiguous per-rank ranges."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // ctx.tp_size)
        self.start = ctx.tp_rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = _set_loader(nn.Parameter(torch.empty(self.per_rank, hidden_size)), self._load)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = self.end - self.start
        param.data[:rows].copy_(loaded.narrow(0, self.start, rows))
        param.data[rows:].zero_()

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        in_range = (token_ids >= self.start) & (token_ids < self.end)
        local = torch.where(in_range, token_ids - self.start, 0)
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.ctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the vocabulary; each rank computes its vocabulary slice, then gathers."""

    kernels = KernelPolicy()  # the model's kernel policy (kernels/policy.py: set_kernel_policy)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.kernels)
        if self.ctx.tp_size == 1:
            return logits
        return self.ctx.all_gather_last_dim(logits)[..., : self.vocab_size]
