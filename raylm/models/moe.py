"""Mixture-of-experts block (Qwen3-MoE), with experts split across ranks (expert parallelism).

Every rank sees every token (activations are replicated after attention) and routes all of them; a rank
computes only the experts it holds, for the tokens routed to them, and the partial outputs are summed
across the tensor-parallel group. With moe_expert_parallel_size = ep < tp, the experts are split into ep
groups and each expert's intermediate dimension is further split across the tp / ep ranks of its group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raylm.kernels.fp8 import FP8_DTYPE
from raylm.kernels.linear import linear
from raylm.kernels.policy import KernelPolicy
from raylm.models.arch import ArchConfig
from raylm.models.parallel import ParallelContext

_CUBLAS = KernelPolicy()  # experts' matmuls: F.linear, or the FP8 matmul for FP8 experts


class MoEBlock(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        ep = ctx.ep_size
        if ctx.tp_size % ep or self.num_experts % ep:
            raise ValueError(f"moe_expert_parallel_size ({ep}) must divide tensor_parallel_size ({ctx.tp_size}) "
                             f"and the number of experts ({self.num_experts})")
        self.expert_tp = ctx.tp_size // ep
        self.expert_tp_rank = ctx.tp_rank % self.expert_tp
        ep_rank = ctx.tp_rank // self.expert_tp
        self.local_count = self.num_experts // ep
        self.first_expert = ep_rank * self.local_count
        if arch.moe_intermediate_size % self.expert_tp:
            raise ValueError(f"moe_intermediate_size ({arch.moe_intermediate_size}) must be divisible by "
                             f"tensor_parallel_size / moe_expert_parallel_size ({self.expert_tp})")
        self.inter = arch.moe_intermediate_size // self.expert_tp
        hidden = arch.hidden_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)  # the router, replicated
        fp8 = arch.fp8 is not None
        weight_dtype = FP8_DTYPE if fp8 else None
        self.w13 = nn.Parameter(torch.empty(self.local_count, 2 * self.inter, hidden, dtype=weight_dtype),
                                requires_grad=not fp8)
        self.w2 = nn.Parameter(torch.empty(self.local_count, hidden, self.inter, dtype=weight_dtype),
                               requires_grad=not fp8)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        # FP8 experts' float32 scales, one per output row of each expert: split with the rows of w13; whole for w2,
        # whose rows (the hidden size) are not split.
        self.w13_scale = self.w2_scale = None
        if fp8:
            self.w13_scale = nn.Parameter(torch.empty(self.local_count, 2 * self.inter, dtype=torch.float32),
                                          requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(self.local_count, hidden, dtype=torch.float32),
                                         requires_grad=False)
            self.w13_scale.weight_loader = self._load_w13
            self.w2_scale.weight_loader = self._load_w2_scale

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.local_count

    # Shard ids: (expert, half) for one expert's projection (half 0: gate, 1: up; None for down); (None, None) for
    # every expert's, stacked as transformers holds them: gate_up_proj [E, 2I, H] (gate rows, then up) and
    # down_proj [E, H, I]. A stacked tensor goes in with one sliced copy: this rank's experts, and of each its
    # rows (w13) or columns (w2) of the intermediate dimension. _load_w13 also takes w13's scales, which are its
    # rows without their columns.

    def _load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]) -> None:
        expert, half = shard_id
        start = self.expert_tp_rank * self.inter
        if expert is None:
            stacked = loaded.narrow(0, self.first_expert, self.local_count)
            columns = tuple(stacked.shape[2:])
            halves = stacked.reshape(self.local_count, 2, -1, *columns).narrow(2, start, self.inter)
            param.data.view(self.local_count, 2, self.inter, *columns).copy_(halves)
            return
        param.data[expert - self.first_expert, half * self.inter : (half + 1) * self.inter].copy_(
            loaded.narrow(0, start, self.inter))

    def _load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int | None, None]) -> None:
        expert, _ = shard_id
        start = self.expert_tp_rank * self.inter
        if expert is None:
            param.data.copy_(loaded.narrow(0, self.first_expert, self.local_count).narrow(2, start, self.inter))
            return
        param.data[expert - self.first_expert].copy_(loaded.narrow(1, start, self.inter))

    def _load_w2_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: tuple[int | None, None]) -> None:
        expert, _ = shard_id
        if expert is None:
            param.data.copy_(loaded.narrow(0, self.first_expert, self.local_count))
            return
        param.data[expert - self.first_expert].copy_(loaded[...])

    @staticmethod
    def _scale(scales: torch.Tensor | None, local: int) -> torch.Tensor | None:
        return None if scales is None else scales[local]

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) as the reference router computes them."""
        logits = F.linear(hidden, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(hidden)
        out = torch.zeros_like(hidden)
        for local in range(self.local_count):
            token_idx, slot = torch.nonzero(experts == self.first_expert + local, as_tuple=True)
            if token_idx.numel() == 0:
                continue
            gate, up = linear(hidden[token_idx], self.w13[local], None, _CUBLAS, self._scale(self.w13_scale, local)
                              ).chunk(2, dim=-1)
            expert_out = linear(F.silu(gate) * up, self.w2[local], None, _CUBLAS, self._scale(self.w2_scale, local))
            out.index_add_(0, token_idx, expert_out * weights[token_idx, slot].unsqueeze(-1))
        return self.ctx.all_reduce(out)
