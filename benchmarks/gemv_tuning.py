"""How long the decode GEMV's tuning takes at a layer shape's first call, its candidate tilings compiled in threads
before they are timed (the default) against one after another as they are timed; each in a Triton cache directory
of its own, empty, so that every tiling compiles. The FP8 Llama-3.1-8B qkv shape (6144 x 4096) at 1 row (the CUDA-core
variant) and at 8 rows (the tensor-core one), as an FP8 engine's start tunes them.

    python benchmarks/gemv_tuning.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

# Run in a fresh process per setting: Triton reads its cache directory at import, and each kernel keeps its compiled
# tilings in memory.
_TUNE_ONCE = """
import sys, time, torch
from raylm.kernels import gemv_tiles
from raylm.kernels.fp8 import quantize_fp8
from raylm.kernels.triton_gemv import gemv
if sys.argv[1] == "serial":
    gemv_tiles.compile_in_threads = lambda *args: None
weight, scale = quantize_fp8(torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16))
for rows in (1, 8):
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    gemv(x, weight, weight_scale=scale, input_mode="float16", tiles="tune")
    torch.cuda.synchronize()
    print(rows, time.perf_counter() - begin)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    result: dict = {"cpus": len(os.sched_getaffinity(0))}
    for mode in ("threads", "serial"):
        with tempfile.TemporaryDirectory() as cache:
            run = subprocess.run([sys.executable, "-c", _TUNE_ONCE, mode], capture_output=True, text=True, check=True,
                                 env={**os.environ, "TRITON_CACHE_DIR": cache},
                                 cwd=Path(__file__).resolve().parent.parent)
        seconds = {f"rows_{rows}_s": float(s) for rows, s in (line.split() for line in run.stdout.split("\n") if line)}
        result[mode] = seconds
        print(f"{mode:>7}: " + ", ".join(f"{key} {value:.1f}" for key, value in seconds.items()), flush=True)
    print(f"wrote {write_result('gemv-tuning-8b-fp8-qkv', args, result)}")


if __name__ == "__main__":
    main()
