"""Speculative decoding against decoding without it, on a workload whose outputs copy their input: chat prompts
asking the model to repeat or lightly edit a paragraph, greedy. One engine with speculative_config runs both:
the plain runs opt out per request (SamplingParams.use_speculative_decoding=False), alternating with the
speculative runs, so both share the engine, its graphs and the machine's drift. Reports per batch size the
end-to-end latency, ms per output token (of the batch's longest output), output tok/s and the acceptance.

    python benchmarks/speculative.py --batch_sizes 1 4 16 --output_len 128
    python benchmarks/speculative.py --set speculative_config.max_draft_len=6
    python benchmarks/speculative.py --set speculative_config.decoding_type=DraftTarget \
        --set speculative_config.speculative_model=PATH
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, build_llm, run_suffix, write_result  # noqa: E402

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase spending on public libraries by ten percent, to repair the bridge on Mill Street before "
    "winter, and to hire two more teachers for the primary school. The proposal to build a new parking garage "
    "was postponed until the spring meeting.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "green light stops blinking. Then open a browser, go to the settings page, and sign in with the password "
    "printed on the label under the device. If the light keeps blinking red, call the support line.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water. "
    "It takes place mainly in the leaves, inside small structures called chloroplasts, which contain the green "
    "pigment chlorophyll. Oxygen is released as a by-product, which is why forests are important for the air.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
]
INSTRUCTIONS = ["Repeat the following text exactly, word for word:", "Fix any spelling mistakes in this text and "
                "return the whole text:", "Rewrite this text, keeping every sentence, with American spelling:"]


def copy_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for index in range(count):
        text = f"{INSTRUCTIONS[index % len(INSTRUCTIONS)]}\n\n{PARAGRAPHS[index % len(PARAGRAPHS)]}"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))
    return prompts


def run(llm, prompts: list[list[int]], output_len: int, speculative: bool) -> dict:
    from raylm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=output_len, temperature=0, use_speculative_decoding=speculative)
    llm.get_stats(timeout=0.5)  # statistics of earlier runs
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.get_stats(timeout=2)
    drafts = sum(s.get("specDecodingStats", {}).get("numDraftTokens", 0) for s in stats)
    accepted = sum(s.get("specDecodingStats", {}).get("numAcceptedTokens", 0) for s in stats)
    verified = sum(s.get("specDecodingStats", {}).get("numRequestsWithDraftTokens", 0) for s in stats)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    return {"latency_s": elapsed, "output_tokens": sum(lengths), "longest": max(lengths), "drafts": drafts,
            "accepted": accepted, "verified": verified, "steps": len(stats),
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--num_iters", type=int, default=3)
    args = parser.parse_args()
    if not any(setting.startswith("speculative_config.decoding_type") for setting in args.settings):
        args.settings = ["speculative_config.decoding_type=NGram", *args.settings]

    llm = build_llm(args, max_seq_len=1024)
    prompts = copy_prompts(llm.tokenizer, max(args.batch_sizes))
    run(llm, prompts[:1], 8, True)  # warm-up
    result = {"batch_sizes": {}}
    print(f"{'batch':>6}{'plain ms/tok':>14}{'spec ms/tok':>13}{'speed-up':>10}{'plain tok/s':>13}{'spec tok/s':>12}"
          f"{'accepted':>10}{'tok/verify':>13}")
    for batch in args.batch_sizes:
        runs: dict[str, list[dict]] = {"plain": [], "speculative": []}
        for _ in range(args.num_iters):
            for name in runs:
                runs[name].append(run(llm, prompts[:batch], args.output_len, name == "speculative"))
        # Greedy outputs are identical in float32 (tests/engine/test_speculative.py); in bf16 a verify step's kernels
        # may round differently from a decode step's, and a near-tie can then go the other way.
        pairs = list(zip(runs["plain"][0]["token_ids"], runs["speculative"][0]["token_ids"]))
        row = {"identical_outputs": sum(plain == spec for plain, spec in pairs) / len(pairs)}
        if row["identical_outputs"] < 1:
            print(f"batch {batch}: {row['identical_outputs']:.0%} of the speculative greedy outputs equal the "
                  "plain ones")
        for name, measured in runs.items():
            latency = statistics.median(m["latency_s"] for m in measured)
            first = measured[0]
            row[name] = {"latency_s": [m["latency_s"] for m in measured], "median_latency_s": latency,
                         "ms_per_token": 1000 * latency / first["longest"],
                         "output_tokens_per_s": first["output_tokens"] / latency, "steps": first["steps"]}
        spec = runs["speculative"][0]
        row["acceptance_rate"] = spec["accepted"] / spec["drafts"] if spec["drafts"] else 0.0
        # Tokens a step with drafts gave its request: its own draw plus the accepted drafts.
        row["tokens_per_verify"] = (spec["verified"] + spec["accepted"]) / spec["verified"] if spec["verified"] else 0.0
        row["speedup"] = row["plain"]["median_latency_s"] / row["speculative"]["median_latency_s"]
        result["batch_sizes"][batch] = row
        print(f"{batch:>6}{row['plain']['ms_per_token']:>14.2f}{row['speculative']['ms_per_token']:>13.2f}"
              f"{row['speedup']:>9.2f}x{row['plain']['output_tokens_per_s']:>13.1f}"
              f"{row['speculative']['output_tokens_per_s']:>12.1f}{row['acceptance_rate']:>10.2f}"
              f"{row['tokens_per_verify']:>13.2f}")
    llm.shutdown()
    name = f"speculative-{Path(args.model or 'smollm2').name}-o{args.output_len}-{llm.info.device}{run_suffix(args)}"
    print(f"wrote {write_result(name, args, result)}")


if __name__ == "__main__":
    main()
