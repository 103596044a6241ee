"""Generate text for a few prompts with the LLM API (CPU by default, the embedded SmolLM2-135M-Instruct).

    python examples/quickstart.py
    python examples/quickstart.py --model path/to/hf-dir --max_tokens 64
"""

from __future__ import annotations

import argparse

from raylm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Three facts about the moon:", "def fibonacci(n):"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--max_tokens", type=int, default=32)
    args = parser.parse_args()
    with LLM(model=args.model) as llm:
        greedy = SamplingParams(max_tokens=args.max_tokens)  # temperature unset: greedy
        sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)
        for params in (greedy, sampled):
            for output in llm.generate(PROMPTS, params):
                print(f"{output.prompt!r} -> {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
