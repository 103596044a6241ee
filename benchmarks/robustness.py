"""The server tried as its users and attackers try it, on the CPU (the OpenAI app over an LLM in this process,
served by uvicorn; no Ray):

    python benchmarks/robustness.py fuzz --max_time 180     # schemathesis against /openapi.json, every route,
                                                            # positive and negative data: no answer may be a 5xx
    python benchmarks/robustness.py load --clients 64 --requests 5760   # streamed greedy requests from many
                                                            # clients: each equals the same request not streamed,
                                                            # no error, and every KV block is free afterwards

The fuzz fixes `model` to the served name in the schema it hands schemathesis (a random name is a 404, which
tests nothing further), and keeps generation short (max_tokens at most 8) so that requests stay cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

SERVED = "raylm-test"


def start_server(args) -> tuple[str, object, object]:
    """The app over an LLM in this process, served by uvicorn on a free port: (base URL, server, llm)."""
    import uvicorn

    from raylm import LLM
    from raylm.serving import LocalEngine, ServingConfig, build_app

    llm = LLM(model=args.model, max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size)
    app = build_app(LocalEngine(llm), ServingConfig(served_model_name=SERVED))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, llm


def _fixed_schema(base_url: str, folder: Path) -> Path:
    """/openapi.json with every `model` field fixed to the served name and max_tokens kept small."""
    import httpx2 as httpx

    schema = httpx.get(f"{base_url}/openapi.json").json()
    for component in schema["components"]["schemas"].values():
        properties = component.get("properties", {})
        if "model" in properties:
            properties["model"] = {"type": "string", "enum": [SERVED]}
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of"):
            if name in properties:
                properties[name] = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 8}, {"type": "null"}]}
    path = folder / "openapi.json"
    path.write_text(json.dumps(schema))
    return path


def fuzz(args) -> dict:
    base_url, server, llm = start_server(args)
    result = {}
    try:
        with tempfile.TemporaryDirectory() as work:
            schema = _fixed_schema(base_url, Path(work))
            for mode in ("positive", "negative"):
                begin = time.perf_counter()
                run = subprocess.run(
                    [str(Path(sys.executable).parent / "schemathesis"), "run", str(schema), "--url", base_url,
                     "--mode", mode, "--checks", "not_a_server_error", "--max-time", str(args.max_time // 2),
                     "--workers", "4",
                     "--phases", "examples,coverage,fuzzing", "--no-color", "--seed", str(args.seed),
                     "--suppress-health-check", "all", "--exclude-path-regex", "profile", "--generation-database",
                     "none", "--request-timeout", "120"],  # a chat without max_tokens runs to max_seq_len on a CPU
                    capture_output=True, text=True)
                output = run.stdout + run.stderr
                result[mode] = {"seconds": time.perf_counter() - begin, "exit_code": run.returncode,
                                "test_cases": _count(r"(\d+) generated", output) or 0,
                                "failed": _count(r"(\d+) failed", output) or 0,  # checks failed: a 5xx
                                "network_errors": _count(r"Network Error: (\d+)", output) or 0,  # no answer
                                "summary": output[-3000:]}
                print(f"{mode}: exit {run.returncode}\n{output[-1500:]}", flush=True)
    finally:
        server.should_exit = True
        llm.shutdown()
    return result


def _count(pattern: str, text: str) -> int | None:
    found = re.findall(pattern, text)
    return sum(int(value) for value in found) if found else None


async def _load(base_url: str, args) -> dict:
    import httpx2 as httpx

    rng = random.Random(args.seed)
    words = ["the", "sea", "a", "cat", "blue", "sky", "runs", "quickly", "under", "old", "tree", "and", "why"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 24))) for _ in range(args.requests)]
    counts = {"requests": 0, "errors": 0, "mismatches": 0}
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": SERVED, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            try:
                whole = (await http.post(f"{base_url}/v1/completions", json=body)).json()["choices"][0]["text"]
                streamed = ""
                async with http.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}) as stream:
                    async for line in stream.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            streamed += json.loads(line[6:])["choices"][0]["text"]
                counts["mismatches"] += streamed != whole
            except Exception:  # any failure counts; the run goes on
                counts["errors"] += 1
            counts["requests"] += 1

    begin = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.clients)) as http:
        await asyncio.gather(*(client(http) for _ in range(args.clients)))
    counts["seconds"] = time.perf_counter() - begin
    return counts


def load(args) -> dict:
    base_url, server, llm = start_server(args)
    try:
        from raylm import SamplingParams

        result = asyncio.run(_load(base_url, args))
        llm.get_stats(timeout=0)  # drop the load's iteration stats
        llm.generate("probe", SamplingParams(max_tokens=1), use_tqdm=False)  # one block of its own
        probe = [stats["kvCacheStats"] for stats in llm.get_stats(timeout=2) if stats.get("kvCacheStats")][-1]
        result["kv_blocks_used_after"] = probe["usedNumBlocks"]  # 0: every block of the load was freed
        result["kv_blocks"] = probe
        print(json.dumps(result, indent=2), flush=True)
    finally:
        server.should_exit = True
        llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["fuzz", "load"])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--max_batch_size", type=int, default=64)
    parser.add_argument("--max_time", type=int, default=180, help="fuzz: seconds for both modes together")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=640, help="load: requests, each sent twice")
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    result = fuzz(args) if args.what == "fuzz" else load(args)
    print(f"wrote {write_result(f'robustness-{args.what}', args, result)}")


if __name__ == "__main__":
    main()
