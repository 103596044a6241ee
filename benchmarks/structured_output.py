"""What structured output costs: ms per output token of a batch decoding under a JSON schema (every row guided:
xgrammar masks made on the host while the device runs the step's forward, applied before the draw) against the
same batch decoding freely. Random token-id prompts, greedy, EOS ignored, fixed output length; the schema is an
unbounded array of objects, so the mask stays on for every token.

    python benchmarks/structured_output.py --batch_sizes 1 8 --output_len 64
    python benchmarks/structured_output.py --model benchmarks/configs/llama-3.1-8b --load_format dummy \\
        --tokenizer PATH --batch_sizes 1 64 --output_len 256
(a config-only --model needs --tokenizer: the grammar is compiled for a vocabulary; one smaller than the model's
leaves the rest of its ids masked.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, llm_options, random_prompts, write_result  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["id", "name", "tags"]}}


def timed_run(llm, prompts, params) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--tokenizer", default=None, help="the tokenizer of a config-only --model")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input_len", type=int, default=128)
    parser.add_argument("--output_len", type=int, default=256)
    parser.add_argument("--num_iters", type=int, default=3)
    args = parser.parse_args()

    from raylm import LLM, GuidedDecodingParams, SamplingParams, TokensPrompt

    options = {"skip_tokenizer_init": False, "tokenizer": args.tokenizer} if args.tokenizer else {}
    max_seq_len = args.input_len + args.output_len + 16
    llm = LLM(executor="local", **{**llm_options(args, max_seq_len), **options})
    free = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    guided = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                            guided_decoding=GuidedDecodingParams(json=SCHEMA))
    vocab = min(llm.info.vocab_size, 32000)
    result = {"schema": SCHEMA, "batches": {}}
    print(f"{'batch':>6} {'free ms/token':>14} {'json ms/token':>14} {'json / free':>12}")
    for batch in args.batch_sizes:
        prompts = [TokensPrompt(prompt_token_ids=p)
                   for p in random_prompts(batch, args.input_len, vocab, args.seed)]
        row = {}
        for name, params in (("free", free), ("json", guided)):
            timed_run(llm, prompts, params)  # warm-up: kernels, graphs, the grammar's compilation
            times = [timed_run(llm, prompts, params) for _ in range(args.num_iters)]
            row[name] = {"e2e_s": times, "ms_per_token": statistics.median(times) / args.output_len * 1000}
        row["ratio"] = row["json"]["ms_per_token"] / row["free"]["ms_per_token"]
        result["batches"][batch] = row
        print(f"{batch:>6} {row['free']['ms_per_token']:>14.3f} {row['json']['ms_per_token']:>14.3f} "
              f"{row['ratio']:>12.3f}", flush=True)
    llm.shutdown()
    name = f"structured-output-{Path(args.model or 'smollm2').name}"
    print(f"wrote {write_result(name, args, result)}")


if __name__ == "__main__":
    main()
