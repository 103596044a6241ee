"""Concurrent requests with generate_async: several chat prompts stream their tokens at once, and the longest is
cancelled midway (its engine request is aborted, its KV cache blocks freed) while the others go on.

    python examples/async_generate.py
"""

from __future__ import annotations

import argparse
import asyncio

from raylm import LLM, SamplingParams
from raylm.inputs import apply_chat_template

QUESTIONS = ["Write a short poem about the sea.", "List five fruits.", "Explain what a CPU does."]
LONG = "Tell a very long story about a dragon who learns to fly."


async def stream(llm: LLM, prompt: str, max_tokens: int, progress: dict[str, str], key: str) -> str:
    async for output in llm.generate_async(prompt, SamplingParams(max_tokens=max_tokens), streaming=True):
        progress[key] = output.outputs[0].text  # everything so far
    return progress[key]


async def main(args) -> None:
    with LLM(model=args.model) as llm:
        progress: dict[str, str] = {}
        prompts = {question: apply_chat_template(llm.tokenizer, [{"role": "user", "content": question}])
                   for question in [*QUESTIONS, LONG]}
        tasks = {question: asyncio.create_task(stream(llm, prompt, args.max_tokens * (8 if question == LONG else 1),
                                                      progress, question))
                 for question, prompt in prompts.items()}
        await asyncio.sleep(args.cancel_after)
        tasks[LONG].cancel()  # its request is aborted in the engine; the others go on
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        for question, result in zip(tasks, results):
            if isinstance(result, asyncio.CancelledError):
                print(f"{question}\n  cancelled after {len(progress.get(question, ''))} characters\n")
            else:
                print(f"{question}\n  {result.strip()!r}\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an instruct model (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--cancel_after", type=float, default=1.0, help="seconds before the long story is cancelled")
    asyncio.run(main(parser.parse_args()))
