"""The prefill's matmuls alone on the Llama-3.1-8B shape (8,192 tokens a step by default): bf16 F.linear against
torch._scaled_mm on FP8 operands with the scales the engine uses (a scale per token and per weight row, rowwise)
and with one scale per tensor, each timed per call from a CUDA graph, in TFLOP/s. Says how far the FP8 prefill's
GEMMs (most of its step, docs/benchmarks.md) sit from what cuBLAS gives these shapes another way.

    python benchmarks/fp8_gemm.py
    python benchmarks/fp8_gemm.py --tokens 4096 8192 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402

# (name, output features, input features) of one Llama-3.1-8B decoder layer's linear layers
LAYERS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def _calls(tokens: int, n: int, k: int) -> dict:
    """The three ways of one [tokens, k] x [n, k]^T product, each a call on its own operands."""
    from raylm.kernels.fp8 import quantize_fp8

    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    xq, x_rows = quantize_fp8(x)
    wq, w_rows = quantize_fp8(w)
    x_tensor, w_tensor = x_rows.amax().reshape(()), w_rows.amax().reshape(())
    return {
        "bf16": lambda: F.linear(x, w),
        "fp8 rowwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_rows[:, None], scale_b=w_rows[None, :],
                                                out_dtype=torch.bfloat16),
        "fp8 per tensor": lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_tensor, scale_b=w_tensor,
                                                   out_dtype=torch.bfloat16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192], help="rows of the activations")
    parser.add_argument("--calls", type=int, default=4, help="calls per CUDA graph")
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_gemm.py times CUDA matmuls: it needs a GPU")

    result: dict = {}
    for tokens in args.tokens:
        for name, n, k in LAYERS:
            calls = _calls(tokens, n, k)
            flops = 2 * tokens * n * k
            for kind, call in calls.items():
                call()
                micros = graph_call_us(lambda call=call: [call() for _ in range(args.calls)], args.calls)
                tflops = flops / micros / 1e6
                result.setdefault(str(tokens), {}).setdefault(name, {})[kind] = {"us": micros, "tflop_per_s": tflops}
                print(f"{tokens:6d} {name:<8} {kind:<15} {micros:9.1f} us {tflops:8.1f} TFLOP/s", flush=True)
    path = write_result("fp8-gemm-8b", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
