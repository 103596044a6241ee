"""Offline throughput, like `vllm bench throughput`: N random-token prompts of I tokens, O tokens out each
(EOS ignored), all submitted at once; output and total tokens per second, engine start excluded.

    python benchmarks/throughput.py --num_prompts 64 --input_len 128 --output_len 128 --peer hf
    python benchmarks/throughput.py --model benchmarks/configs/llama-3.1-8b --load_format dummy \\
        --num_prompts 1000 --input_len 1024 --output_len 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    add_model_args,
    build_llm,
    hf_peer,
    random_prompts,
    release_device_memory,
    run_suffix,
    synchronize,
    write_result,
)


def run_raylm(llm, prompts, output_len: int, num_iters: int) -> list[float]:
    """Seconds of each of num_iters runs of the whole workload on one engine."""
    from raylm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], SamplingParams(max_tokens=4),
                 use_tqdm=False)  # warm-up
    runs = []
    for _ in range(num_iters):
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return runs


def run_hf(model, prompts, output_len: int, device: str) -> float:
    """HF transformers' continuous batching (generate_batch), EOS never reached."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():  # not inference_mode: generate_batch updates its cache from a thread of its own
        model.generate_batch(inputs=prompts[:2], generation_config=config, progress_bar=False)
        synchronize(device)
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        synchronize(device)
        elapsed = time.perf_counter() - start
    lengths = [len(out.generated_tokens) for out in outputs.values()]
    if len(lengths) != len(prompts) or min(lengths) != output_len:
        first = next(iter(outputs.values()), None)
        raise RuntimeError(f"generate_batch returned {len(lengths)} outputs, lengths {lengths[:4]}...; first: "
                           f"{getattr(first, 'status', None)} {getattr(first, 'error', None)}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--num_prompts", type=int, default=64)
    parser.add_argument("--input_len", type=int, default=128)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--num_iters", type=int, default=1,
                        help="runs of the workload on one engine; the median is reported (the HF peer runs once)")
    args = parser.parse_args()
    if args.num_iters < 1:
        parser.error(f"--num_iters must be >= 1, got {args.num_iters}")

    begin = time.perf_counter()
    llm = build_llm(args, max_seq_len=args.input_len + args.output_len + 16)
    startup = time.perf_counter() - begin
    print(f"engine started in {startup:.1f} s", flush=True)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.info.vocab_size, args.seed)
    runs = run_raylm(llm, prompts, args.output_len, args.num_iters)
    elapsed = statistics.median(runs)
    output_tokens = args.num_prompts * args.output_len
    total_tokens = args.num_prompts * (args.input_len + args.output_len)
    result = {"raylm": {"elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
                        "total_tokens_per_s": total_tokens / elapsed, "requests_per_s": args.num_prompts / elapsed,
                        "runs_s": runs, "startup_s": startup}}
    rows = [("raylm", elapsed)]
    info = llm.info
    llm.shutdown()  # the peer gets the device's memory to itself
    del llm
    release_device_memory(info.device)
    if args.peer == "hf":
        model = hf_peer(args, info)
        peer = run_hf(model, prompts, args.output_len, info.device)
        result["hf"] = {"elapsed_s": peer, "output_tokens_per_s": output_tokens / peer,
                        "total_tokens_per_s": total_tokens / peer, "requests_per_s": args.num_prompts / peer}
        result["speedup_vs_hf"] = peer / elapsed
        rows.append(("hf transformers", peer))

    name = f"throughput-{Path(args.model or 'smollm2').name}-n{args.num_prompts}-i{args.input_len}-" \
           f"o{args.output_len}-{info.device}{run_suffix(args)}"
    path = write_result(name, args, result)
    print(f"\n{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out) on {info.device} "
          f"({info.dtype})")
    print(f"{'engine':<18}{'elapsed (s)':>12}{'output tok/s':>14}{'total tok/s':>13}{'req/s':>9}")
    for label, seconds in rows:
        print(f"{label:<18}{seconds:>12.2f}{output_tokens / seconds:>14.1f}{total_tokens / seconds:>13.1f}"
              f"{args.num_prompts / seconds:>9.2f}")
    if len(runs) > 1:
        print(f"raylm runs (s): {', '.join(f'{r:.2f}' for r in runs)} (median above)")
    if "speedup_vs_hf" in result:
        print(f"raylm / hf speed ratio: {result['speedup_vs_hf']:.2f}x")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
