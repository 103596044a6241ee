"""A multi-turn chat through the model's chat template: each answer joins the conversation before the next
question.

    python examples/chat.py
    python examples/chat.py --model path/to/instruct-model
"""

from __future__ import annotations

import argparse

from raylm import LLM, SamplingParams
from raylm.inputs import apply_chat_template

QUESTIONS = ["What is the capital of France?", "What is a famous museum there?", "What can I see in it?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an instruct model (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max_tokens", type=int, default=48)
    args = parser.parse_args()
    conversation = []  # the template puts in the model's own system prompt
    with LLM(model=args.model) as llm:
        for question in QUESTIONS:
            conversation.append({"role": "user", "content": question})
            prompt = apply_chat_template(llm.tokenizer, conversation)  # the template adds the assistant's turn
            answer = llm.generate(prompt, SamplingParams(max_tokens=args.max_tokens)).outputs[0].text.strip()
            conversation.append({"role": "assistant", "content": answer})
            print(f"user: {question}\nassistant: {answer}\n")


if __name__ == "__main__":
    main()
