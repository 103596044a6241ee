"""Talk to a raylm server (`raylm serve`, or `serve run examples/serving/serve_config.yaml`) with the official
openai client: one chat completion streamed to the terminal.

    raylm serve --port 8000 &
    python examples/serving/client.py "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import os

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--base_url", default="http://localhost:8000/v1")
    parser.add_argument("--api_key", default=os.environ.get("RAYLM_API_KEY", "unused"),
                        help="the server's API key (default: $RAYLM_API_KEY)")
    parser.add_argument("--model", default=None, help="served model name (default: the first one /v1/models lists)")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.prompt}],
                                            max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage is not None:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} generated tokens]")


if __name__ == "__main__":
    main()
