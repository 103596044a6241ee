"""A batch job (raylm batch, Ray Data) against the engine called directly on the same prompts, like `vllm bench
throughput`: random token-id prompts of --input_len, --output_len tokens each (greedy, EOS ignored).

The job runs with each --replicas count, timed whole (Ray Data starts the replicas; their load is part of a job's
time) and over its answering alone (from the first block a replica took to the last it answered); the engine's
peer is LLM.generate in this process, timed without its start-up and with it. Ratios say what Ray Data costs and
what more replicas buy.

    python benchmarks/batch_job.py --num_prompts 512 --input_len 32 --output_len 32 --replicas 1 2
    python benchmarks/batch_job.py --model benchmarks/configs/llama-3.1-8b --load_format dummy \\
        --tokenizer PATH --num_prompts 1000 --input_len 1024 --output_len 1024 --replicas 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, llm_options, random_prompts, write_result  # noqa: E402


def engine_run(args, prompts: list[list[int]]) -> dict:
    from raylm import LLM, SamplingParams, TokensPrompt

    begin = time.perf_counter()
    llm = LLM(executor="local", **llm_options(args, args.max_seq_len))
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    done = time.perf_counter()
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"start_s": started - begin, "generate_s": done - started, "total_s": done - begin,
            "generated_tokens": tokens, "tok_s": tokens / (done - started), "tok_s_with_start": tokens / (done - begin)}


def job_run(args, rows_file: Path, replicas: int, workdir: Path) -> dict:
    from raylm.batch import BatchArgs, run_batch

    options = {key: value for key, value in llm_options(args, args.max_seq_len).items() if value is not None}
    options.pop("device", None)
    summary = run_batch(BatchArgs(input=str(rows_file), output=str(workdir / f"out-{replicas}"),
                                  num_replicas=replicas, rows_per_block=args.rows_per_block,
                                  blocks_in_flight=args.blocks_in_flight, device=args.device, **options))
    return {**summary.to_dict(), "tok_s": summary.generated_tokens_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer for a config-only --model")
    parser.add_argument("--num_prompts", type=int, default=512)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=32)
    parser.add_argument("--max_seq_len", type=int, default=None)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows_per_block", type=int, default=64)
    parser.add_argument("--blocks_in_flight", type=int, default=4)
    args = parser.parse_args()
    args.max_seq_len = args.max_seq_len or args.input_len + args.output_len + 16
    if args.tokenizer:
        args.settings.append(f"tokenizer={args.tokenizer}")
    vocab = 49152 if args.model is None else 32000
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    result = {"engine": engine_run(args, prompts)}
    print(f"engine: {result['engine']['tok_s']:.1f} tok/s ({result['engine']['tok_s_with_start']:.1f} with its "
          f"start-up)", flush=True)
    with tempfile.TemporaryDirectory() as work:
        workdir = Path(work)
        rows_file = workdir / "rows.jsonl"
        rows_file.write_text("".join(json.dumps({"prompt": p, "max_tokens": args.output_len, "ignore_eos": True,
                                                 "temperature": 0}) + "\n" for p in prompts))
        for replicas in args.replicas:
            run = job_run(args, rows_file, replicas, workdir)
            run["vs_engine"] = run["tok_s"] / result["engine"]["tok_s"]
            run["vs_engine_with_start"] = run["tok_s"] / result["engine"]["tok_s_with_start"]
            run["answering_vs_engine"] = run["answering_tokens_per_s"] / result["engine"]["tok_s"]
            result[f"job_{replicas}_replicas"] = run
            print(f"job, {replicas} replica(s): {run['tok_s']:.1f} tok/s whole, {run['vs_engine']:.3f} of the "
                  f"engine's ({run['vs_engine_with_start']:.3f} of its rate with start-up); answering "
                  f"{run['answering_tokens_per_s']:.1f} tok/s over {run['answering_seconds']:.1f} s of "
                  f"{run['seconds']:.1f}, {run['answering_vs_engine']:.3f} of the engine's; {run['errors']} errors",
                  flush=True)
    name = f"batch-job-{Path(args.model or 'smollm2').name}-n{args.num_prompts}-i{args.input_len}-o{args.output_len}"
    print(f"wrote {write_result(name, args, result)}")


if __name__ == "__main__":
    main()
