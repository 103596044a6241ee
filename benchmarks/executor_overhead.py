"""The cost of the Ray executor against the in-process one: the same model, batch and prompts through both,
iterations interleaved; also the Ray start-up time inside LLM().

    python benchmarks/executor_overhead.py --batch_sizes 1 32 --input_len 32 --output_len 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, build_llm, random_prompts, write_result  # noqa: E402
from benchmarks.latency import measure, raylm_runner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--num_iters", type=int, default=3)
    parser.add_argument("--num_iters_warmup", type=int, default=1)
    args = parser.parse_args()

    max_seq_len = args.input_len + args.output_len + 16
    begin = time.perf_counter()
    local = build_llm(args, max_seq_len, executor="local")
    local_start = time.perf_counter() - begin
    begin = time.perf_counter()
    remote = build_llm(args, max_seq_len, executor="ray")
    ray_start = time.perf_counter() - begin
    result = {"startup_s": {"local": local_start, "ray": ray_start},
              "ray_startup_metrics": remote.startup_metrics.get("ray_executor", {}), "batches": {}}
    print(f"LLM() start-up: in-process {local_start:.2f} s, Ray {ray_start:.2f} s "
          f"({result['ray_startup_metrics']})")
    print(f"{'batch':>6}{'local tok/s':>14}{'ray tok/s':>12}{'ray / local':>13}")
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.input_len, local.info.vocab_size, args.seed)
        times = measure({"local": raylm_runner(local, prompts, args.output_len),
                         "ray": raylm_runner(remote, prompts, args.output_len)}, args.num_iters, args.num_iters_warmup)
        tokens = batch * args.output_len
        rates = {name: tokens / statistics.mean(values) for name, values in times.items()}
        result["batches"][batch] = {"latency_s": times, "output_tokens_per_s": rates,
                                    "ray_over_local": rates["ray"] / rates["local"]}
        print(f"{batch:>6}{rates['local']:>14.1f}{rates['ray']:>12.1f}{rates['ray'] / rates['local']:>13.3f}")
    local.shutdown()
    remote.shutdown()
    path = write_result(f"executor-overhead-{Path(args.model or 'smollm2').name}-{local.info.device}", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
