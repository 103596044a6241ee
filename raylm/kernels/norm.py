"""RMSNorm, with and without a fused residual add (torch reference)."""

from __future__ import annotations

import torch
from torch import nn

from raylm.kernels.policy import KernelPolicy


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalises in float32 and scales in the input dtype, as the reference models do."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


class RMSNorm(nn.Module):
    kernels = KernelPolicy()  # the model's kernel policy (kernels/policy.py: set_kernel_policy)

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # The linear layer this norm's output goes to, where it may take FP8 rows (models/parallel.py's
        # takes_fp8_rows): the Triton norm then writes them, and the layer does not quantize its input itself.
        # Kept out of the module tree (a plain attribute of a tuple), so that parameters are not listed twice.
        self._fp8_consumer: tuple[nn.Module, ...] = ()

    def feeds(self, linear: nn.Module) -> None:
        """Names the linear layer that takes this norm's output (see _fp8_consumer)."""
        self._fp8_consumer = (linear,)

    def forward(self, x, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). x may be a row-parallel
        layer's Unreduced partial sum (models/parallel.py): the sum over ranks is then taken first, in one kernel
        with the add and the norm where the context's fused_norm takes it. x may also be a LoRA layer's output with
        its products still to add (models/lora.py's PendingProducts): added in the same kernel on Triton. Where the
        linear it feeds takes FP8 rows for x, the output is those rows (kernels/fp8.py's Fp8Rows)."""
        pdl = self.kernels.pdl
        if hasattr(x, "products"):  # a LoRA layer's output and its products, still to add (models/lora.py)
            if residual is not None and self.kernels.on_triton(x.out) and not self._writes_fp8(x.out):
                from raylm.kernels import triton_ops

                return triton_ops.fused_add_rms_norm(x.out, residual, self.weight, self.eps, pdl, extra=x.products)
            x = x.materialize()
        if hasattr(x, "partial"):  # Unreduced
            fused = x.ctx.fused_norm
            if residual is not None and fused is not None and fused.fits(x.partial):
                return fused(x.partial, residual, self.weight, self.eps, pdl)
            x = x.reduce()
        if self.kernels.on_triton(x):
            from raylm.kernels import triton_ops

            if self._writes_fp8(x):
                rows, new_residual = triton_ops.rms_norm_fp8(x, residual, self.weight, self.eps, pdl)
                return rows if residual is None else (rows, new_residual)
            if residual is None:
                return triton_ops.rms_norm(x, self.weight, self.eps, pdl)
            return triton_ops.fused_add_rms_norm(x, residual, self.weight, self.eps, pdl)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x

    def _writes_fp8(self, x: torch.Tensor) -> bool:
        """Whether the Triton norm writes FP8 rows for x (the linear it feeds takes them)."""
        return bool(self._fp8_consumer) and self.weight.dtype == x.dtype and self._fp8_consumer[0].takes_fp8_rows(x)
