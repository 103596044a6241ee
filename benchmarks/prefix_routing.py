"""Prefix-aware routing against power-of-two-choices across engine replicas of the Ray Serve app: a workload of a
few shared system prompts x many users (each request: one of the system prompts, then a user's own tokens), sent
by streaming clients; per request router, the prefix-cache hit rate (cached prompt tokens / prompt tokens, as the
engines report them in each response's usage) and TTFT.

The KV cache of each replica should hold its share of the system prompts (by default: as many as prefix-aware
routing may place on one replica, and the requests in flight): then routing can keep every prompt cached on the
replica that serves it, while a router blind to prefixes sends every prompt to every replica.

    python benchmarks/prefix_routing.py --num_replicas 2 --num_prefixes 8 --prefix_len 256 --num_requests 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, llm_options, write_result  # noqa: E402
from raylm.serving.prefix_router import PLACEMENT_SLACK  # noqa: E402

POLICIES = ("prefix_aware", "pow2")


@dataclass
class Outcome:
    """One request as the client saw it."""

    ttft_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


def shared_prefix_prompts(num_prefixes: int, prefix_len: int, num_requests: int, suffix_len: int, vocab_size: int,
                          seed: int) -> list[list[int]]:
    """num_requests token-id prompts: rounds over the system prompts in a shuffled order, each followed by a user's
    own suffix_len tokens."""
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)

    def tokens(length: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(length)]

    prefixes = [tokens(prefix_len) for _ in range(num_prefixes)]
    prompts: list[list[int]] = []
    while len(prompts) < num_requests:
        order = list(range(num_prefixes))
        rng.shuffle(order)
        prompts += [prefixes[index] + tokens(suffix_len) for index in order]
    return prompts[:num_requests]


async def _send(session, url: str, model: str, prompt: list[int], output_len: int) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    outcome = Outcome()
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return outcome
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                outcome.error = chunk["error"]["message"]
            elif chunk.get("choices") and math.isnan(outcome.ttft_s):
                outcome.ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
                outcome.prompt_tokens = usage["prompt_tokens"]
                outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return outcome


async def send_all(url: str, model: str, prompts: list[list[int]], output_len: int,
                   max_concurrency: int) -> tuple[list[Outcome], float]:
    """Streams every prompt, at most max_concurrency at a time, in order; the outcomes and the wall time."""
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        async def one(prompt: list[int]) -> Outcome:
            async with limit:
                return await _send(session, url, model, prompt, output_len)

        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(prompt) for prompt in prompts))
    return list(outcomes), time.perf_counter() - start


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    ok = [outcome for outcome in outcomes if outcome.error is None]
    ttfts = sorted(1000 * outcome.ttft_s for outcome in ok)
    prompt_tokens = sum(outcome.prompt_tokens for outcome in ok)
    return {
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({outcome.error for outcome in outcomes if outcome.error})[:5],
        "duration_s": duration,
        "hit_rate": sum(outcome.cached_tokens for outcome in ok) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": {"mean": statistics.mean(ttfts) if ttfts else math.nan,
                    "median": statistics.median(ttfts) if ttfts else math.nan,
                    "p99": ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else math.nan},
    }


def run_policy(config, prompts: list[list[int]], output_len: int, max_concurrency: int,
               app_name: str = "raylm-prefix-routing") -> dict:
    """Deploys the app of `config` (start_server), sends the prompts, takes the app down; the summary."""
    from raylm.serving.ray_serve import start_server

    server = start_server(config, app_name=app_name)
    try:
        outcomes, duration = asyncio.run(send_all(server.url, config.model_name, prompts, output_len,
                                                  max_concurrency))
    finally:
        server.stop()
    return summarize(outcomes, duration)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--num_replicas", type=int, default=2)
    parser.add_argument("--num_prefixes", type=int, default=8, help="shared system prompts")
    parser.add_argument("--prefix_len", type=int, default=256, help="tokens of each system prompt")
    parser.add_argument("--suffix_len", type=int, default=32, help="each user's own tokens after it")
    parser.add_argument("--num_requests", type=int, default=256)
    parser.add_argument("--output_len", type=int, default=8)
    parser.add_argument("--max_concurrency", type=int, default=8)
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--max_imbalance", type=int, default=16, help="prefix_routing_max_imbalance")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.set_defaults(max_batch_size=32)
    args = parser.parse_args()
    if args.kv_cache_max_tokens is None:  # a replica's share of the system prompts, plus the requests in flight
        share = math.ceil(PLACEMENT_SLACK * args.num_prefixes / args.num_replicas)
        in_flight = args.max_concurrency * (args.suffix_len + args.output_len + args.tokens_per_block)
        args.kv_cache_max_tokens = share * args.prefix_len + in_flight

    from raylm.serving.config import ServeArgs

    prompts = shared_prefix_prompts(args.num_prefixes, args.prefix_len, args.num_requests, args.suffix_len,
                                    _vocab_size(args), args.seed)
    options = llm_options(args, max_seq_len=args.prefix_len + args.suffix_len + args.output_len + 16)
    options["model"] = options["model"] or "smollm2-135m-instruct"
    options["kv_cache_config"].update(enable_block_reuse=True, tokens_per_block=args.tokens_per_block)
    results = {}
    for policy in args.policies:
        config = ServeArgs(**options, served_model_name="bench", host="127.0.0.1", port=_free_port(),
                           api_key=None, num_replicas=args.num_replicas, request_router=policy,
                           prefix_routing_max_imbalance=args.max_imbalance, max_queue=max(1024, args.num_requests))
        results[policy] = run_policy(config, prompts, args.output_len, args.max_concurrency)

    name = f"prefix-routing-{Path(args.model or 'smollm2').name}-r{args.num_replicas}-p{args.num_prefixes}" \
           f"x{args.prefix_len}-n{args.num_requests}-c{args.max_concurrency}"
    path = write_result(name, args, {"results": results})
    print(f"\n{args.num_requests} requests: {args.num_prefixes} system prompts of {args.prefix_len} tokens + "
          f"{args.suffix_len} user tokens, {args.output_len} out; {args.num_replicas} replicas, KV cache "
          f"{args.kv_cache_max_tokens} tokens each, concurrency {args.max_concurrency}")
    print(f"{'router':<14}{'done':>6}{'failed':>8}{'hit rate':>10}{'TTFT mean':>11}{'median':>9}{'p99':>9}"
          f"{'wall s':>8}")
    for policy, result in results.items():
        ttft = result["ttft_ms"]
        print(f"{policy:<14}{result['completed']:>6}{result['failed']:>8}{result['hit_rate']:>10.3f}"
              f"{ttft['mean']:>11.1f}{ttft['median']:>9.1f}{ttft['p99']:>9.1f}{result['duration_s']:>8.1f}")
        for error in result["errors"]:
            print(f"  error: {error}")
    print(f"wrote {path}")


def _vocab_size(args: argparse.Namespace) -> int:
    from raylm.models.loader import load_hf_config
    from raylm.models.source import resolve_model

    return load_hf_config(resolve_model(args.model), False).vocab_size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
