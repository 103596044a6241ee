"""Host time against GPU time per eager call of the kernels a short prompt's prefill launches, on the Llama-3.1-8B
layer shapes: where the host takes longer to issue a call than the GPU takes to run it, an eager prefill of that
many tokens leaves the GPU idle between its kernels (the batch-1 FP8 step profile shows gaps of ~65 us before each
torch._scaled_mm of a 32-token prefill; this says which calls cost that on the host).

    python benchmarks/launch_cost.py                 # 32 rows
    python benchmarks/launch_cost.py --rows 8 32 128

Host time: `calls` calls issued back to back after a warm-up, without synchronizing between them (few enough that
the launch queue never fills), over the wall clock. GPU time: the same calls captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402

HIDDEN, QKV, INTERMEDIATE = 4096, 6144, 14336  # Llama-3.1-8B


def operations(rows: int) -> dict:
    """name -> a call of one prefill kernel (or layer) at `rows` tokens, on inputs made once."""
    from raylm.kernels import triton_ops
    from raylm.kernels.fp8 import fp8_linear, quantize_fp8
    from raylm.kernels.triton_fp8 import quantize_rows_fp8

    device, dtype = torch.device("cuda"), torch.bfloat16
    x = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, device=device, dtype=dtype)
    norm_weight = torch.ones(HIDDEN, device=device, dtype=dtype)
    weight = torch.randn(QKV, HIDDEN, device=device, dtype=dtype) / HIDDEN**0.5
    weight_fp8, weight_scale = quantize_fp8(weight)
    x_fp8, x_scale = quantize_rows_fp8(x)
    return {
        "F.linear bf16 (qkv)": lambda: F.linear(x, weight),
        "quantize_rows_fp8": lambda: quantize_rows_fp8(x),
        "torch._scaled_mm rowwise (qkv)": lambda: torch._scaled_mm(
            x_fp8, weight_fp8.t(), scale_a=x_scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0),
            out_dtype=torch.bfloat16),
        "fp8_linear (quantize + _scaled_mm)": lambda: fp8_linear(x, weight_fp8, weight_scale),
        "rms_norm": lambda: triton_ops.rms_norm(x, norm_weight, 1e-5),
        "fused_add_rms_norm": lambda: triton_ops.fused_add_rms_norm(x, residual, norm_weight, 1e-5),
        "rms_norm_fp8": lambda: triton_ops.rms_norm_fp8(x, None, norm_weight, 1e-5),
        "silu_and_mul_fp8": lambda: triton_ops.silu_and_mul_fp8(gate_up),
        "empty (torch's own floor)": lambda: torch.empty(rows, HIDDEN, device=device, dtype=dtype),
    }


def host_us(call, calls: int) -> float:
    for _ in range(3):
        call()  # compiles and tunes
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[32])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("launch_cost.py measures CUDA launches: it needs a CUDA device")
    results = []
    for rows in args.rows:
        for name, call in operations(rows).items():
            host = host_us(call, args.calls)
            gpu = graph_call_us(lambda call=call: [call() for _ in range(args.calls)], args.calls)
            results.append({"op": name, "rows": rows, "host_us": round(host, 1), "gpu_us": round(gpu, 1),
                            "host_bound": host > gpu})
            print(f"{rows:>5} rows  {name:<38} host {host:7.1f} us  GPU {gpu:7.1f} us"
                  f"{'  host-bound' if host > gpu else ''}", flush=True)
    path = write_result("launch-cost-8b", args, {"results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
