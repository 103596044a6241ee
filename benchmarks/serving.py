"""Online serving, like `vllm bench serve`: a streaming client sends random token-id prompts (fixed input and
output lengths, EOS ignored, greedy) at a request rate or with a fixed number of clients, and reports TTFT,
TPOT and ITL (mean, median, p99) and output tok/s.

Backends: `serve` deploys the Ray Serve app (`raylm serve`) on a local Ray cluster and streams from its OpenAI
endpoint over HTTP; `engine` runs the same client workload against the engine called directly
(LLM.generate_async in this process, on a Ray worker like the Serve deployment's engine); `both` runs the two in
turn and reports the difference, the cost of the Serve hop (HTTP, the ingress and the engine deployment). The
engine's own TTFT (its arrival to first token) differs between runs by more than that hop, so the hop is also
given as each path's client TTFT less the engine's own, subtracted.

    python benchmarks/serving.py --backend both --max_concurrency 16 --num_prompts 32
    python benchmarks/serving.py --backend both --max_concurrency 1 --num_prompts 8
    python benchmarks/serving.py --base_url http://localhost:8000 --request_rate 4   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, llm_options, random_prompts, write_result  # noqa: E402


@dataclass
class RequestRecord:
    """One request as the client saw it: when its tokens arrived, relative to when it was sent."""

    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between successive chunks that carried tokens
    error: str | None = None
    engine_ttft_s: float | None = None  # the engine's own TTFT (its arrival to first token), engine backend only


class ChunkClock:
    """Times the chunks of one streamed request."""

    def __init__(self):
        self.start = time.perf_counter()
        self.last: float | None = None
        self.record = RequestRecord()

    def tokens(self, total: int) -> None:
        """A chunk arrived; `total` tokens have been generated so far."""
        if total <= self.record.output_tokens:
            return
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self.last)
        self.last = now
        self.record.output_tokens = total

    def done(self) -> RequestRecord:
        self.record.latency_s = time.perf_counter() - self.start
        return self.record


Send = Callable[[list[int]], Awaitable[RequestRecord]]


# ---------------------------------------------------------------------------------------------- backends


def openai_sender(session, base_url: str, model: str, api_key: str | None, output_len: int) -> Send:
    """Streams /v1/completions; continuous usage stats give the tokens generated so far in every chunk."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def send(prompt: list[int]) -> RequestRecord:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        clock = ChunkClock()
        async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                clock.record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return clock.done()
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    clock.record.error = chunk["error"]["message"]
                elif chunk.get("usage"):
                    clock.tokens(chunk["usage"]["completion_tokens"])
        return clock.done()

    return send


def engine_sender(llm, output_len: int) -> Send:
    from raylm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)

    async def send(prompt: list[int]) -> RequestRecord:
        clock = ChunkClock()
        async for output in llm.generate_async(TokensPrompt(prompt_token_ids=prompt), params, streaming=True):
            clock.tokens(len(output.outputs[0].token_ids))
            if clock.record.engine_ttft_s is None:
                clock.record.engine_ttft_s = output.metrics.get("time_to_first_token")
        return clock.done()

    return send


# ---------------------------------------------------------------------------------------------- workload


async def run_workload(send: Send, prompts: list[list[int]], request_rate: float, max_concurrency: int | None,
                       seed: int) -> tuple[list[RequestRecord], float]:
    """Sends every prompt, at Poisson arrivals of request_rate per second (inf: all at once), at most
    max_concurrency at a time; returns the records and the wall time."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)

    async def one(prompt: list[int]) -> RequestRecord:
        if limit is None:
            return await send(prompt)
        async with limit:
            return await send(prompt)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"mean": 1000 * statistics.mean(values), "median": 1000 * statistics.median(values), "p99": 1000 * p99}


def summarize(records: list[RequestRecord], duration: float) -> dict:
    ok = [record for record in records if record.error is None]
    output_tokens = sum(record.output_tokens for record in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({record.error for record in records if record.error})[:5],
        "duration_s": duration, "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_tokens_per_s": output_tokens / duration,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]), "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_latency_ms": _stats_ms([r.latency_s for r in ok]),
        **({"engine_ttft_ms": _stats_ms(engine_ttfts)} if (engine_ttfts := [
            r.engine_ttft_s for r in ok if r.engine_ttft_s is not None]) else {}),
    }


@dataclass
class Workload:
    warmup: list[list[int]]  # sent one by one before measuring
    prompts: list[list[int]]


async def measure(send: Send, args: argparse.Namespace, workload: Workload,
                  server: Callable[[], Awaitable[dict[str, list[float]]]] | None = None) -> dict:
    """The workload's summary, with the CPU each process of this machine's Ray session used while it ran. With
    `server` (the server's histograms, [sum, count] by name), the measured requests' mean on each: the time their
    messages spent on each hop between the server and its engine, and the server's own TTFT, which, taken from the
    client's, leaves what Serve's proxy and the HTTP client added."""
    for prompt in workload.warmup:
        await send(prompt)
    before = await server() if server else {}
    cpu = ProcessCpu()
    records, duration = await run_workload(send, workload.prompts, args.request_rate, args.max_concurrency,
                                           args.seed)
    summary = summarize(records, duration)
    summary["cpu_utilization"] = cpu.utilization()
    if server:
        after = await server()
        summary["server_mean_ms"] = {}
        for name, (total, count) in after.items():
            earlier_total, earlier_count = before.get(name, [0.0, 0])
            if count > earlier_count:
                summary["server_mean_ms"][name] = (total - earlier_total) / (count - earlier_count) * 1000
    return summary


class ProcessCpu:
    """CPU time of this process and of every Ray process of the machine (grouped by process title: the proxy,
    each deployment's replicas, the engine's workers), from now to utilization(), as a fraction of one core."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times = self._read()

    @staticmethod
    def _read() -> dict[int, tuple[str, float]]:
        import psutil

        times = {}
        for process in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                title = " ".join(process.info["cmdline"] or []).split(" ", 1)[0]
                if process.pid == os.getpid():
                    title = "benchmark (client)"
                elif not title.startswith("ray::"):
                    continue
                used = process.cpu_times()
                # "ray::Class.method" names the task running now: the actor is the class.
                times[process.pid] = (title.split(".", 1)[0], used.user + used.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return times

    def utilization(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        by_title: dict[str, float] = {}
        for pid, (title, used) in self._read().items():
            earlier = self.times.get(pid, (title, 0.0))[1]
            by_title[title] = by_title.get(title, 0.0) + (used - earlier) / wall
        return {title: round(share, 3) for title, share in sorted(by_title.items(), key=lambda item: -item[1])
                if share >= 0.01}


_SERVER_HISTOGRAMS = {"raylm_request_hop_seconds": "hop", "raylm_time_to_first_token_seconds": "ttft",
                      "raylm_e2e_request_latency_seconds": "e2e",
                      "raylm_engine_time_to_first_token_seconds": "engine_ttft"}


async def server_histograms(session, base_url: str) -> dict[str, list[float]]:
    """[sum, count] of the server's histograms (its /prometheus/metrics): each hop of raylm_request_hop_seconds by
    its hop label, TTFT and end-to-end latency."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{base_url}/prometheus/metrics") as response:
        text = await response.text()
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        short = _SERVER_HISTOGRAMS.get(family.name)
        for sample in family.samples if short else ():
            position = {"_sum": 0, "_count": 1}.get(sample.name.removeprefix(family.name))
            if position is not None:
                name = sample.labels["hop"] if short == "hop" else short
                sums.setdefault(name, [0.0, 0])[position] += sample.value
    return sums


# ---------------------------------------------------------------------------------------------- runs


def serve_args(args: argparse.Namespace):
    from raylm.serving.config import ServeArgs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = llm_options(args, max_seq_len=args.input_len + args.output_len + 16)
    options["model"] = options["model"] or "smollm2-135m-instruct"
    return ServeArgs(**options, served_model_name="bench", host="127.0.0.1", port=port,
                     max_queue=max(1024, args.num_prompts), api_key=None, ingress=args.ingress,
                     ingress_replicas=args.ingress_replicas, http_proxy=args.http_proxy)


async def _over_http(base_url: str, model: str, api_key: str | None, args, workload: Workload) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        return await measure(openai_sender(session, base_url, model, api_key, args.output_len), args, workload,
                             server=lambda: server_histograms(session, base_url))


def run_serve(args: argparse.Namespace, config, workload: Workload) -> dict:
    from raylm.serving.ray_serve import start_server

    server = start_server(config, app_name="raylm-bench")
    try:
        return {**asyncio.run(_over_http(server.url, config.model_name, None, args, workload)),
                "layout": server.layout}
    finally:
        server.stop()


def run_engine(args: argparse.Namespace, config, workload: Workload) -> dict:
    from raylm import LLM

    llm = LLM(**{**config.llm_kwargs(), "executor": args.engine_executor})
    try:
        return asyncio.run(measure(engine_sender(llm, args.output_len), args, workload))
    finally:
        llm.shutdown()


def run_base_url(args: argparse.Namespace, workload: Workload) -> dict:
    import httpx2

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx2.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    return asyncio.run(_over_http(args.base_url.rstrip("/"), model, args.api_key, args, workload))


def vocab_size(args: argparse.Namespace) -> int:
    from raylm.models.loader import load_hf_config
    from raylm.models.source import resolve_model

    return load_hf_config(resolve_model(args.model), False).vocab_size


def _over_engine_ttft(result: dict) -> float | None:
    """The client's mean TTFT less the engine's own mean TTFT (the server's histogram, or the engine's outputs)."""
    engine = result.get("server_mean_ms", {}).get("engine_ttft", result.get("engine_ttft_ms", {}).get("mean"))
    return None if engine is None else result["ttft_ms"]["mean"] - engine


def _row(label: str, result: dict) -> str:
    def triple(key: str) -> str:
        stats = result[key]
        return f"{stats['mean']:>8.1f}{stats['median']:>8.1f}{stats['p99']:>8.1f}"

    return (f"{label:<14}{result['completed']:>5}{result['output_tokens_per_s']:>10.1f}"
            f"{triple('ttft_ms')}{triple('tpot_ms')}{triple('itl_ms')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--backend", choices=["serve", "engine", "both"], default="both")
    parser.add_argument("--base_url", default=None,
                        help="benchmark a running server instead (e.g. http://localhost:8000); no engine starts")
    parser.add_argument("--api_key", default=os.environ.get("RAYLM_API_KEY"), help="for --base_url")
    parser.add_argument("--ingress", choices=["deployment", "engine", "auto"], default="auto",
                        help="serve backend: the HTTP app on an ingress deployment, or on each engine replica "
                             "(ServeArgs.ingress; auto: the engine replica for one replica)")
    parser.add_argument("--ingress_replicas", type=int, default=None,
                        help="serve backend with --ingress deployment: replicas of the ingress deployment")
    parser.add_argument("--http_proxy", choices=["serve", "haproxy", "auto"], default="auto",
                        help="serve backend: what listens on the server's port (ServeArgs.http_proxy)")
    parser.add_argument("--engine_executor", choices=["ray", "local"], default="ray",
                        help="executor of the direct engine (ray: a worker actor, as the Serve deployment has)")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=64)
    parser.add_argument("--request_rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max_concurrency", type=int, default=None, help="most requests in flight (clients)")
    parser.add_argument("--num_warmup", type=int, default=2, help="requests sent one by one before measuring")
    args = parser.parse_args()

    prompts = random_prompts(args.num_prompts + args.num_warmup, args.input_len, vocab_size(args), args.seed)
    workload = Workload(warmup=prompts[args.num_prompts:], prompts=prompts[: args.num_prompts])
    results: dict[str, dict] = {}
    config = None
    if args.base_url:
        results["server"] = run_base_url(args, workload)
    else:
        config = serve_args(args)
        if args.backend in ("engine", "both"):
            results["engine"] = run_engine(args, config, workload)
        if args.backend in ("serve", "both"):
            results["serve"] = run_serve(args, config, workload)
    if {"engine", "serve"} <= set(results):
        results["serve_hop_ms"] = {metric: {stat: results["serve"][metric][stat] - results["engine"][metric][stat]
                                            for stat in ("mean", "median", "p99")}
                                   for metric in ("ttft_ms", "tpot_ms", "itl_ms")}
        # The engine's own TTFT (its arrival to first token) differs from run to run by more than the hop; what
        # each path adds over it does not.
        over = [_over_engine_ttft(results[label]) for label in ("engine", "serve")]
        if None not in over:
            results["serve_hop_ms"]["ttft_over_engine_ms"] = {"engine": over[0], "serve": over[1],
                                                              "hop": over[1] - over[0]}

    load = f"c{args.max_concurrency}" if args.max_concurrency else f"r{args.request_rate:g}"
    engine_layout = config is not None and config.ingress_layout == "engine"
    load += "-engine-ingress" if engine_layout and args.backend != "engine" else ""
    load += f"-ingress{args.ingress_replicas}" if args.ingress_replicas and args.backend != "engine" else ""
    name = f"serving-{Path(args.model or 'smollm2').name}-{load}-i{args.input_len}-o{args.output_len}-" \
           f"{args.device if args.device != 'auto' else _device()}"
    path = write_result(name, args, {"results": results})
    print(f"\n{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), "
          f"concurrency {args.max_concurrency or 'unbounded'}, request rate {args.request_rate:g}/s")
    print(f"{'':<14}{'':>5}{'':>10}{'TTFT (ms)':>24}{'TPOT (ms)':>24}{'ITL (ms)':>24}")
    if "serve" in results and "layout" in results["serve"]:
        print(f"serve layout (ingress, http_proxy): {results['serve']['layout']}")
    print(f"{'backend':<14}{'done':>5}{'out tok/s':>10}" + f"{'mean':>8}{'median':>8}{'p99':>8}" * 3)
    for label, result in results.items():
        if label != "serve_hop_ms":
            print(_row(label, result))
            for error in result["errors"]:
                print(f"  error: {error}")
    if "serve_hop_ms" in results:
        hop = results["serve_hop_ms"]
        print(f"Serve hop (serve - engine): TTFT mean {hop['ttft_ms']['mean']:+.1f} ms, median "
              f"{hop['ttft_ms']['median']:+.1f} ms; ITL mean {hop['itl_ms']['mean']:+.1f} ms, median "
              f"{hop['itl_ms']['median']:+.1f} ms")
        if "ttft_over_engine_ms" in hop:
            over = hop["ttft_over_engine_ms"]
            print(f"Serve hop over the engine's own TTFT: client TTFT - engine's TTFT {over['serve']:+.1f} ms through "
                  f"the server, {over['engine']:+.1f} ms called directly: hop {over['hop']:+.1f} ms")
    for label, result in results.items():
        if label == "serve_hop_ms":
            continue
        server = result.get("server_mean_ms", {})
        hops = {name: ms for name, ms in server.items() if name not in ("ttft", "e2e", "engine_ttft")}
        if hops:
            print(f"{label}: mean time between server and engine: " + ", ".join(
                f"{hop} {ms:.2f} ms" for hop, ms in sorted(hops.items())))
        if "ttft" in server:
            print(f"{label}: the server's mean TTFT {server['ttft']:.1f} ms, the client's "
                  f"{result['ttft_ms']['mean']:.1f}: {result['ttft_ms']['mean'] - server['ttft']:+.1f} ms outside the "
                  "server (proxy, HTTP, client)")
        engine_ttft = server.get("engine_ttft", result.get("engine_ttft_ms", {}).get("mean"))
        if engine_ttft is not None:
            print(f"{label}: the engine's own mean TTFT (its arrival to first token) {engine_ttft:.1f} ms")
        print(f"{label}: CPU (cores) " + ", ".join(f"{title} {share:.2f}"
                                                 for title, share in result["cpu_utilization"].items()))
    print(f"wrote {path}")


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
