"""Throughput against batch size: one engine (max_batch_size = the largest size given); for each batch size B,
B random prompts of I tokens, O tokens out each (EOS ignored), submitted at once so that B sequences decode
together; output tokens/s and ms per decode step for each B, as JSON and as a plot (PNG, matplotlib) for
docs/benchmarks.md. `--peer hf` adds HF transformers' generate_batch on the same prompts, after the engine is
shut down.

    python benchmarks/batch_sweep.py --model benchmarks/configs/llama-3.1-8b --load_format dummy \\
        --batch_sizes 1 4 16 64 256 --plot docs/images/throughput-vs-batch-llama-3.1-8b.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    add_model_args,
    build_llm,
    hf_peer,
    machine,
    random_prompts,
    release_device_memory,
    run_suffix,
    write_result,
)
from benchmarks.throughput import run_hf  # noqa: E402


def sweep_raylm(llm, prompts: list[list[int]], batch_sizes: list[int], output_len: int) -> dict[int, float]:
    """Seconds to generate output_len tokens for each of the first B prompts, per batch size B."""
    from raylm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], SamplingParams(max_tokens=4),
                 use_tqdm=False)  # warm-up
    seconds = {}
    for size in batch_sizes:
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:size]], params, use_tqdm=False)
        seconds[size] = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        print(f"batch {size:>4}: {size * output_len / seconds[size]:>10.1f} output tok/s", flush=True)
    return seconds


def plot(path: Path, batch_sizes: list[int], series: dict[str, dict[int, float]], title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install 'raylm[bench]'); {path} not drawn")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, values in series.items():
        sizes = [size for size in batch_sizes if size in values]
        axes.plot(sizes, [values[size] for size in sizes], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(batch_sizes, [str(size) for size in batch_sizes])
    axes.set_xlabel("batch size (sequences decoding together)")
    axes.set_ylabel("output tokens / s")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--input_len", type=int, default=128)
    parser.add_argument("--output_len", type=int, default=256)
    parser.add_argument("--plot", default=None, help="PNG to draw (default: next to the JSON result)")
    args = parser.parse_args()
    sizes = sorted(set(args.batch_sizes))
    if sizes[0] < 1:
        parser.error(f"--batch_sizes must be at least 1, got {sizes[0]}")
    args.max_batch_size = max(args.max_batch_size, sizes[-1])

    llm = build_llm(args, max_seq_len=args.input_len + args.output_len + 16)
    info = llm.info
    prompts = random_prompts(sizes[-1], args.input_len, info.vocab_size, args.seed)
    seconds = {"raylm": sweep_raylm(llm, prompts, sizes, args.output_len)}
    llm.shutdown()
    del llm
    release_device_memory(info.device)
    if args.peer == "hf":
        model = hf_peer(args, info)
        seconds["hf transformers"] = {}
        for size in sizes:
            seconds["hf transformers"][size] = run_hf(model, prompts[:size], args.output_len, info.device)
            print(f"hf batch {size:>4}: {size * args.output_len / seconds['hf transformers'][size]:>10.1f} "
                  "output tok/s", flush=True)

    throughput = {name: {size: size * args.output_len / s for size, s in values.items()}
                  for name, values in seconds.items()}
    result = {name: {str(size): {"elapsed_s": seconds[name][size], "output_tokens_per_s": throughput[name][size],
                                 "ms_per_step": 1000 * seconds[name][size] / args.output_len}
                     for size in values} for name, values in seconds.items()}
    model_name = Path(args.model or "smollm2").name
    name = f"batch-sweep-{model_name}-i{args.input_len}-o{args.output_len}-{info.device}{run_suffix(args)}"
    path = write_result(name, args, result)
    picture = Path(args.plot) if args.plot else path.with_suffix(".png")
    plot(picture, sizes, throughput, f"{model_name}, {args.input_len} in / {args.output_len} out, {info.dtype}, "
                                     f"{machine()}{run_suffix(args)}")
    if picture.exists():
        print(f"drew {picture}")
    print(f"\n{'batch':>6}" + "".join(f"{label:>18}" for label in throughput))
    for size in sizes:
        print(f"{size:>6}" + "".join(f"{throughput[label].get(size, float('nan')):>18.1f}" for label in throughput))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
