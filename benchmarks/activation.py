"""The SiLU-and-mul kernels alone on a prefill step of the Llama-3.1-8B shape (8,192 rows of gate and up, 14,336
features each, bf16): silu_and_mul (bf16 out), and silu_and_mul_fp8 (FP8 rows and their scales out, for the FP8 down
projection) under its tiles: a row held whole in one program (the default: a warp per 512 features, at most 16; or
--whole_warps), read twice in chunks (its amax, then its bytes), or whole rows from a fixed number of programs, each
requesting its next row before it computes the current one (--programs programs:warps). Each is timed per call from
a CUDA graph, with the rate at which it moves its bytes.

    python benchmarks/activation.py
    python benchmarks/activation.py --rows 4096 --chunks 1024:4 2048:4 2048:8 4096:8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--size", type=int, default=14336, help="features of gate (and of up)")
    parser.add_argument("--chunks", nargs="+", default=["1024:4", "2048:4", "2048:8", "4096:8", "4096:16"],
                        help="chunk:warps of the two-pass silu_and_mul_fp8 to time")
    parser.add_argument("--whole_warps", type=int, nargs="*", default=[4, 8, 32],
                        help="warps a program of the whole-row silu_and_mul_fp8 to time beside its default")
    parser.add_argument("--programs", nargs="*", default=["sms:16", "sms:32", "2sms:16"],
                        help="programs:warps of silu_and_mul_fp8's whole rows from a fixed number of programs "
                             "(sms: one an SM, 2sms: two)")
    parser.add_argument("--calls", type=int, default=4, help="calls per CUDA graph")
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/activation.py times CUDA kernels: it needs a GPU")
    from raylm.kernels.triton_ops import silu_and_mul, silu_and_mul_fp8

    gate_up = torch.randn(args.rows, 2 * args.size, device="cuda", dtype=torch.bfloat16) * 4
    read = gate_up.numel() * gate_up.element_size()
    result: dict = {"rows": args.rows, "size": args.size}
    reference = silu_and_mul_fp8(gate_up)

    def timed(name: str, call, written: int) -> None:
        call()  # compiles outside the capture
        micros = graph_call_us(lambda: [call() for _ in range(args.calls)], args.calls)
        result[name] = {"us": micros, "tb_per_s": (read + written) / micros / 1e6}
        print(f"{name:<28} {micros:9.1f} us  {result[name]['tb_per_s']:.2f} TB/s", flush=True)

    timed("silu_and_mul (bf16 out)", lambda: silu_and_mul(gate_up), args.rows * args.size * 2)
    fp8_bytes = args.rows * (args.size + 4)
    timed("silu_and_mul_fp8 whole rows", lambda: silu_and_mul_fp8(gate_up), fp8_bytes)
    for warps in args.whole_warps:
        timed(f"silu_and_mul_fp8 whole:{warps}", lambda warps=warps: silu_and_mul_fp8(gate_up, num_warps=warps),
              fp8_bytes)
    for entry in args.chunks:
        chunk, warps = (int(part) for part in entry.split(":"))
        rows = silu_and_mul_fp8(gate_up, chunk=chunk, num_warps=warps)
        if not (torch.equal(rows.scale, reference.scale)
                and torch.equal(rows.values.view(torch.uint8), reference.values.view(torch.uint8))):
            sys.exit(f"chunk {chunk}, {warps} warps: other bytes than whole rows")
        timed(f"silu_and_mul_fp8 {chunk}:{warps}",
              lambda chunk=chunk, warps=warps: silu_and_mul_fp8(gate_up, chunk=chunk, num_warps=warps), fp8_bytes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for entry in args.programs:
        count, warps = entry.split(":")
        programs = {"sms": sms, "2sms": 2 * sms}.get(count) or int(count)
        rows = silu_and_mul_fp8(gate_up, num_warps=int(warps), programs=programs)
        if not (torch.equal(rows.scale, reference.scale)
                and torch.equal(rows.values.view(torch.uint8), reference.values.view(torch.uint8))):
            sys.exit(f"{programs} programs, {warps} warps: other bytes than one program a row")
        timed(f"silu_and_mul_fp8 programs {programs}:{warps}",
              lambda programs=programs, warps=int(warps): silu_and_mul_fp8(gate_up, num_warps=warps,
                                                                          programs=programs), fp8_bytes)
    path = write_result(f"activation-8b-r{args.rows}", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
