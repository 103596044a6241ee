"""Linear layers' matmul: cuBLAS (F.linear), the Triton GEMV for decode-sized inputs where the model's kernel
policy says so (kernels/policy.py), or the FP8 matmul for weights stored in FP8 (kernels/fp8.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylm.kernels.fp8 import Fp8Rows, fp8_linear
from raylm.kernels.policy import KernelPolicy


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None, policy: KernelPolicy,
           weight_scale: torch.Tensor | None = None, lora=None) -> torch.Tensor:
    """x @ weight.T + bias, through the Triton GEMV (kernels/triton_gemv.py) where policy.gemv_applies; an FP8
    weight comes with its per-row weight_scale and goes through the GEMV the same way (weights widened, x kept as
    it is), else through kernels/fp8.py (x quantized to FP8 too). lora: the rows' shrunk LoRA inputs
    (kernels/triton_lora.py's LoraRows), whose products the expand kernel adds to the output after the matmul."""
    if policy.gemv_applies(x, weight):
        from raylm.kernels.triton_gemv import gemv

        out = gemv(x, weight, bias, weight_scale=weight_scale, input_mode=policy.gemv_input_mode(weight_scale, x),
                   pdl=policy.pdl, tiles=policy.gemv_tiles, prefetch=policy.gemv_prefetch)
    elif weight_scale is not None:  # x may come as FP8 rows, quantized by the RMSNorm before
        out = fp8_linear(x, weight, weight_scale, bias)
    else:
        out = F.linear(x, weight, bias)
    if lora is not None:
        from raylm.kernels.triton_lora import lora_expand

        lora_expand(out.view(-1, out.shape[-1]), lora, policy.pdl)
    return out
