"""A batch job on Ray Data: writes a small JSONL of prompts and OpenAI Batch requests, answers it with engine
replicas (raylm.batch.run_batch, what `raylm batch` runs), and prints the answers.

    python examples/batch_infer.py                      # a local Ray cluster, CPU replicas
    ray job submit --working-dir . -- python examples/batch_infer.py --replicas 2   # on a running cluster
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from raylm.batch import run_batch

ROWS = [
    {"prompt": "The capital of France is", "id": "capital"},
    {"messages": [{"role": "user", "content": "Name a primary colour."}], "id": "colour"},
    {"custom_id": "request-1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Once upon a time", "max_tokens": 16}},
    {"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 16}},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory, .gguf or hub id (default: embedded SmolLM2)")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--max_tokens", type=int, default=16,
                        help="the table rows' max_tokens (an OpenAI request carries its own)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        rows = Path(work) / "rows.jsonl"
        rows.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
        output = Path(work) / "answers"
        summary = run_batch(input=str(rows), output=str(output), num_replicas=args.replicas,
                            sampling={"max_tokens": args.max_tokens, "temperature": 0},
                            **({"model": args.model} if args.model else {}))
        print(summary)
        for file in sorted(output.glob("*.jsonl")):
            for line in file.read_text().splitlines():
                answer = json.loads(line)
                if "custom_id" in answer:
                    body = answer["response"]["body"]
                    choice = body["choices"][0]
                    print(f"{answer['custom_id']}: {choice.get('text') or choice['message']['content']!r}")
                else:
                    print(f"{answer['row_id']}: {answer['generated_text']!r}")


if __name__ == "__main__":
    main()
