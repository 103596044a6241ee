"""models/parallel.py: a row-parallel layer's Unreduced partial sum, taken by the RMSNorm after it."""

from __future__ import annotations

from dataclasses import replace

import torch

from raylm.kernels.norm import RMSNorm
from raylm.kernels.policy import KernelPolicy
from raylm.models.parallel import SINGLE, RowParallelLinear, Unreduced


class RecordingFusedNorm:
    """Stands in for distributed.SymmetricAllReduceNorm: takes rows of width 8, records its calls."""

    def __init__(self):
        self.calls = []

    def fits(self, partial: torch.Tensor) -> bool:
        return partial.shape[-1] == 8

    def __call__(self, partial, residual, weight, eps, pdl=0):
        self.calls.append(pdl)
        return "fused", "residual"


def test_row_parallel_layers_defer_their_reduce_only_when_asked_and_without_bias():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    plain = RowParallelLinear(4, 8, bias=False)
    torch.nn.init.normal_(plain.weight)
    deferred = plain(x, defer_reduce=True)
    assert isinstance(deferred, Unreduced)
    torch.testing.assert_close(deferred.reduce(), plain(x))  # one rank: the sum is the partial itself
    biased = RowParallelLinear(4, 8, bias=True)
    assert isinstance(biased(x, defer_reduce=True), torch.Tensor)  # the bias is added after the sum


def test_the_norm_takes_an_unreduced_sum_fused_where_it_fits_else_reduced_first():
    torch.manual_seed(1)
    norm = RMSNorm(8, 1e-6)
    partial, residual = torch.randn(2, 8), torch.randn(2, 8)
    fused = RecordingFusedNorm()
    ctx = replace(SINGLE, fused_norm=fused)
    norm.kernels = KernelPolicy(triton=True, pdl=4)
    assert norm(Unreduced(partial, ctx), residual) == ("fused", "residual")
    assert fused.calls == [4]  # launched as the model's kernel policy says
    norm.kernels = KernelPolicy()
    expected_out, expected_residual = norm(partial, residual)
    out, new_residual = norm(Unreduced(partial, SINGLE), residual)  # no fused kernel: reduced, then normalised
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(new_residual, expected_residual)
    wide = Unreduced(torch.randn(2, 16), ctx)  # does not fit the fused kernel: reduced, then normalised
    out, _ = RMSNorm(16, 1e-6)(wide, torch.randn(2, 16))
    assert isinstance(out, torch.Tensor) and fused.calls == [4]
