"""What a setting that trades precision for speed (FP8 weights, the FP8 KV cache) does to a real model's outputs:
the same greedy generations with the engine's defaults and with the settings given by --set, compared token by
token. Reports how many generated tokens agree before each prompt's first difference (and in all), and the mean and
largest |logprob gap| over the prompt tokens (teacher-forced, so every position compares) and over the generated
tokens before the first difference.

    python benchmarks/accuracy.py --set kv_cache_config.dtype=fp8                     # CPU, SmolLM2 (fp32)
    python benchmarks/accuracy.py --dtype bfloat16 --set quant_config.quant_algo=FP8  # on a GPU
    python benchmarks/accuracy.py --tiny qwen3_moe --dtype bfloat16 --set quant_config.quant_algo=FP8
                                  # a tiny random model of the tests' (2 layers, hidden 64), token-id prompts
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, llm_options, random_prompts, run_suffix, write_result  # noqa: E402

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "Explain how a transformer model works.",
    "List five prime numbers and explain why they are prime.", "What is the boiling point of water at altitude?",
    "Describe the history of the Roman Empire in a few sentences.", "How do airplanes stay in the air?",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?", "Translate 'good morning' into French, Spanish and German.",
    "Explain recursion to a ten-year-old.", "What causes the seasons on Earth?",
    "Write a haiku about autumn leaves.", "How does a refrigerator keep food cold?",
]


def generate(args: argparse.Namespace, with_settings: bool) -> list:
    from raylm import LLM, SamplingParams, TokensPrompt

    options = llm_options(args, max_seq_len=512)
    if not with_settings:
        options = llm_options(argparse.Namespace(**{**vars(args), "settings": []}), max_seq_len=512)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, logprobs=0, prompt_logprobs=0,
                            ignore_eos=True)
    prompts = PROMPTS[: args.num_prompts]
    if args.tiny:  # no tokenizer: random token-id prompts of 24 tokens
        options["skip_tokenizer_init"] = True
        from tests.conftest import _tiny_config

        ids = random_prompts(args.num_prompts, 24, _tiny_config(args.tiny).vocab_size, seed=args.seed)
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in ids]
    with LLM(**options) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def tiny_model(arch: str, directory: Path) -> Path:
    """The tests' tiny random model of `arch` (tests/conftest.py's configurations, seeded as there), saved under
    directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_config

    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32).save_pretrained(directory)
    return directory


def compare(reference: list, variant: list) -> dict:
    agreed, generated, prompt_gaps, generated_gaps = 0, 0, [], []
    for ours, theirs in zip(reference, variant):
        ours_out, theirs_out = ours.outputs[0], theirs.outputs[0]
        first = next((i for i, (a, b) in enumerate(zip(ours_out.token_ids, theirs_out.token_ids)) if a != b),
                     len(ours_out.token_ids))
        agreed += first
        generated += len(ours_out.token_ids)
        for i in range(first):
            token = ours_out.token_ids[i]
            generated_gaps.append(abs(ours_out.logprobs[i][token].logprob - theirs_out.logprobs[i][token].logprob))
        for position, other in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            prompt_gaps += [abs(position[token].logprob - other[token].logprob) for token in position if token in other]
    return {"prompts": len(reference), "generated_tokens": generated,
            "tokens_before_first_difference": agreed, "agreement": agreed / generated,
            "prompt_logprob_gap": {"mean": statistics.mean(prompt_gaps), "max": max(prompt_gaps),
                                   "count": len(prompt_gaps)},
            "generated_logprob_gap": {"mean": statistics.mean(generated_gaps) if generated_gaps else 0.0,
                                      "max": max(generated_gaps, default=0.0), "count": len(generated_gaps)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--num_prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--tiny", default=None, choices=["llama", "qwen2", "qwen3", "qwen3_moe"],
                        help="a tiny random model of the tests' instead of --model")
    args = parser.parse_args()
    if not args.settings:
        sys.exit("give the settings to compare with --set PATH=VALUE")
    if args.num_prompts > len(PROMPTS):
        sys.exit(f"--num_prompts is at most {len(PROMPTS)}")
    with tempfile.TemporaryDirectory() as directory:
        if args.tiny:
            args.model = str(tiny_model(args.tiny, Path(directory) / f"tiny-{args.tiny}"))
        result = compare(generate(args, False), generate(args, True))
    name = f"accuracy-{Path(args.model or 'smollm2').name}{run_suffix(args)}"
    path = write_result(name, args, result)
    print(f"{result['prompts']} prompts, {result['generated_tokens']} greedy tokens: "
          f"{result['tokens_before_first_difference']} agree before each prompt's first difference "
          f"({result['agreement']:.1%})")
    for key, label in (("prompt_logprob_gap", "prompt tokens"), ("generated_logprob_gap", "generated tokens")):
        gap = result[key]
        print(f"|logprob gap| over {gap['count']} {label}: mean {gap['mean']:.4f}, max {gap['max']:.4f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
