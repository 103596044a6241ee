"""Latency of one batch, like `vllm bench latency`: batch B of random prompts of I tokens, O tokens out
(EOS ignored, greedy), mean and median end-to-end seconds over iterations; the prefill alone (one output token),
so the decode steps' ms/token apart from it; also start-up time to the first token.

    python benchmarks/latency.py --batch_size 1 --input_len 32 --output_len 128 --peer hf
    python benchmarks/latency.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --batch_size 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    add_model_args,
    build_llm,
    hf_peer,
    random_prompts,
    run_suffix,
    synchronize,
    write_result,
)


def raylm_runner(llm, prompts, output_len: int):
    from raylm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run() -> float:
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        return elapsed

    return run


def hf_runner(model, prompts, output_len: int, device: str):
    input_ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, num_beams=1,
                  pad_token_id=0, attention_mask=torch.ones_like(input_ids))

    def run() -> float:
        with torch.inference_mode():
            synchronize(device)
            start = time.perf_counter()
            out = model.generate(input_ids, **kwargs)
            synchronize(device)
            elapsed = time.perf_counter() - start
        assert out.shape[1] == input_ids.shape[1] + output_len
        return elapsed

    return run


def measure(runners: dict, iters: int, warmup: int) -> dict[str, list[float]]:
    """Runs the engines in turn, iteration by iteration, so drift of the machine hits both alike."""
    for _ in range(warmup):
        for run in runners.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(iters):
        for name, run in runners.items():
            times[name].append(run())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--num_iters", type=int, default=3)
    parser.add_argument("--num_iters_warmup", type=int, default=1)
    args = parser.parse_args()

    from raylm import SamplingParams, TokensPrompt

    begin = time.perf_counter()
    llm = build_llm(args, max_seq_len=args.input_len + args.output_len + 16)
    startup = time.perf_counter() - begin
    prompts = random_prompts(args.batch_size, args.input_len, llm.info.vocab_size, args.seed)
    llm.generate(TokensPrompt(prompt_token_ids=prompts[0]), SamplingParams(max_tokens=1, ignore_eos=True))
    first_token = time.perf_counter() - begin

    runners = {"raylm": raylm_runner(llm, prompts, args.output_len)}
    if args.peer == "hf":
        runners["hf"] = hf_runner(hf_peer(args, llm.info), prompts, args.output_len, llm.info.device)
    times = measure(runners, args.num_iters, args.num_iters_warmup)
    # The prompts' prefill alone (one output token; the prefix cache is off, so each run computes them again): what
    # of the latency is the prefill, and what the decode steps.
    prefill = raylm_runner(llm, prompts, 1)
    prefill()
    prefills = [prefill() for _ in range(args.num_iters)]
    llm.shutdown()
    tokens = args.batch_size * args.output_len
    result = {}
    for name, latencies in times.items():
        mean, median = statistics.mean(latencies), statistics.median(latencies)
        result[name] = {"latency_s": latencies, "mean_latency_s": mean, "median_latency_s": median,
                        "ms_per_output_token": 1000 * mean / args.output_len, "output_tokens_per_s": tokens / mean,
                        "median_ms_per_output_token": 1000 * median / args.output_len}
    median_prefill = statistics.median(prefills)
    decode_ms = 1000 * (result["raylm"]["median_latency_s"] - median_prefill) / max(1, args.output_len - 1)
    result["raylm"].update(startup_s=startup, startup_to_first_token_s=first_token, prefill_s=prefills,
                           median_prefill_s=median_prefill, decode_ms_per_token=decode_ms)
    if "hf" in times:
        result["speedup_vs_hf"] = result["hf"]["mean_latency_s"] / result["raylm"]["mean_latency_s"]
    rows = [(name if name == "raylm" else "hf transformers", result[name]["mean_latency_s"],
             result[name]["median_latency_s"]) for name in times]

    name = f"latency-{Path(args.model or 'smollm2').name}-b{args.batch_size}-i{args.input_len}-o{args.output_len}-" \
           f"{llm.info.device}{run_suffix(args)}"
    path = write_result(name, args, result)
    print(f"\nbatch {args.batch_size}, input {args.input_len}, output {args.output_len} on {llm.info.device} "
          f"({llm.info.dtype}); start-up {startup:.2f} s, first token at {first_token:.2f} s")
    print(f"{'engine':<18}{'mean e2e (s)':>14}{'ms/token':>12}{'out tok/s':>12}{'median e2e (s)':>16}"
          f"{'ms/token':>10}")
    for label, latency, median in rows:
        print(f"{label:<18}{latency:>14.3f}{1000 * latency / args.output_len:>12.2f}{tokens / latency:>12.1f}"
              f"{median:>16.3f}{1000 * median / args.output_len:>10.2f}")
    print(f"raylm's prefill alone (median): {1000 * median_prefill:.1f} ms; the decode steps after it: "
          f"{decode_ms:.2f} ms/token")
    if "speedup_vs_hf" in result:
        print(f"raylm / hf speed ratio: {result['speedup_vs_hf']:.2f}x")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
