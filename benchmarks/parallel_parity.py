"""Greedy tokens of a multi-GPU layout against one GPU: the same random prompts, the same (dummy or real)
weights, N tokens each; prints where each prompt's tokens first differ and exits 1 if any does.

    python benchmarks/parallel_parity.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --tp 2
    python benchmarks/parallel_parity.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --pp 2

Both engines run on Ray workers (one after the other), so each GPU's memory is free for the next layout.
Dummy weights are the same model for every layout (each rank draws a tensor whole and keeps its shard).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, build_llm, parallel_suffix, random_prompts, write_result  # noqa: E402


def greedy(args: argparse.Namespace, prompts: list[list[int]] | None, num_prompts: int) -> tuple[list, list]:
    from raylm import SamplingParams, TokensPrompt

    llm = build_llm(args, max_seq_len=args.input_len + args.output_len + 16, executor="ray")
    try:
        prompts = prompts or random_prompts(num_prompts, args.input_len, llm.info.vocab_size, args.seed)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(max_tokens=args.output_len, ignore_eos=True, logprobs=1),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    return prompts, [o.outputs[0] for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--num_prompts", type=int, default=4)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=64)
    args = parser.parse_args()
    if args.tp * args.pp == 1:
        parser.error("give the layout to compare with one GPU: --tp and/or --pp above 1")

    single = copy.copy(args)
    single.tp = single.pp = 1
    begin = time.perf_counter()
    prompts, reference = greedy(single, None, args.num_prompts)
    _, parallel = greedy(args, prompts, args.num_prompts)
    rows = []
    for index, (ours, ref) in enumerate(zip(parallel, reference)):
        first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)) if a != b), None)
        row = {"prompt": index, "equal": ours.token_ids == ref.token_ids, "first_difference": first}
        if first is not None:  # how close the one-GPU run's top two were there: a near tie flips under rounding
            top = sorted(ref.logprobs[first].values(), key=lambda entry: -entry.logprob)
            row["reference_logprob_at_difference"] = top[0].logprob
            row["parallel_logprob_at_difference"] = ours.logprobs[first][ours.token_ids[first]].logprob
        rows.append(row)
    equal = all(row["equal"] for row in rows)
    result = {"equal": equal, "prompts": rows, "tokens_per_prompt": args.output_len,
              "reference_tokens": [o.token_ids for o in reference], "seconds": time.perf_counter() - begin}
    name = f"parallel-parity-{Path(args.model or 'smollm2').name}{parallel_suffix(args)}"
    path = write_result(name, args, result)
    layout = parallel_suffix(args).strip("-").replace("-", " ")
    for row in rows:
        status = "equal" if row["equal"] else f"differs from token {row['first_difference']}"
        print(f"prompt {row['prompt']}: {layout} vs one GPU, {args.output_len} greedy tokens: {status}")
    print(f"{'ALL EQUAL' if equal else 'DIFFERENT'}; wrote {path}")
    sys.exit(0 if equal else 1)


if __name__ == "__main__":
    main()
