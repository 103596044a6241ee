"""Tunes the decode GEMV on this GPU for a model's layer shapes and ships the result: the tiles each kernel variant's
tuning chose go into raylm/kernels/gemv_tiles.json under the GPU's model name, where engines started with
kernel_config.gemv_tiles="shipped" (the default) take them without tuning (kernels/gemv_tiles.py).

It starts an engine in this process with gemv_tiles="tune" (warm-up and graph capture tune every variant its decode
steps meet), then merges what was chosen into the table; entries of other models and GPUs stay.

    python benchmarks/tune_gemv.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --max_batch_size 8
    python benchmarks/tune_gemv.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --max_batch_size 8 \\
        --set quant_config.quant_algo=FP8

A max batch of at least 8 tunes the tensor-core variants at 8 rows, as an engine of that size or more does (the
tuning is per layer shape, at its first call: the largest decode graph's rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, build_llm, write_result  # noqa: E402


def main() -> None:
    from raylm.kernels import gemv_tiles

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--max_seq_len", type=int, default=2048)
    parser.add_argument("--table", default=str(gemv_tiles.TABLE_PATH), help="the table to merge into")
    args = parser.parse_args()
    args.settings.append("kernel_config.gemv_tiles=tune")

    begin = time.perf_counter()
    llm = build_llm(args, max_seq_len=args.max_seq_len, executor="local")
    seconds = time.perf_counter() - begin
    llm.shutdown()
    new = gemv_tiles.chosen()
    if not new:
        sys.exit("no GEMV was tuned: the decode GEMV runs on CUDA devices, for models that stream weights or with "
                 "--set kernel_config.decode_gemv=true")
    path = Path(args.table)
    path.write_text(gemv_tiles.dumps(gemv_tiles.merged(gemv_tiles.load_table(path), new)))
    print(f"engine started in {seconds:.1f} s, tuning included")
    for device, variants in new.items():
        for variant, shapes in sorted(variants.items()):
            for shape, tiling in sorted(shapes.items()):
                print(f"{device} | {variant} | {shape}: {tiling}")
    print(f"wrote {path}")
    write_result(f"tune-gemv-{Path(args.model or 'smollm2').name}", args,
                 {"engine_start_s": seconds, "tiles": new})


if __name__ == "__main__":
    main()
