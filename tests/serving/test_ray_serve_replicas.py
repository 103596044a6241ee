"""Several engine replicas of the Ray Serve app on a local Ray cluster, over a tiny model: prefix-aware routing
raises the prefix-cache hit rate of a shared-system-prompt workload over power-of-two choices, and autoscaling
goes from 1 to 2 replicas under load (each engine in its own placement group) and back to 1 without failing a
request, draining the streams in flight on the replica it removes."""

from __future__ import annotations

import threading
import time

import httpx2
import pytest

from benchmarks.prefix_routing import run_policy, shared_prefix_prompts
from raylm import KvCacheConfig
from raylm.serving.config import ServeArgs
from raylm.serving.ray_serve import start_server
from tests.serving.conftest import free_port

pytestmark = pytest.mark.slow
MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="module")
def port(ray_cluster):
    from ray import serve

    yield free_port()
    serve.shutdown()


def test_prefix_aware_routing_raises_the_hit_rate_of_shared_system_prompts_over_pow2(tiny_model_dirs, port):
    num_prefixes, prefix_len, suffix_len, output_len, concurrency = 8, 8 * BLOCK, 8, 2, 4
    prompts = shared_prefix_prompts(num_prefixes, prefix_len, num_requests=96, suffix_len=suffix_len,
                                    vocab_size=49152, seed=0)
    # Each replica's cache holds five system prompts and the requests in flight: all that prefix-aware routing
    # sends it, but not the eight that reach every replica without it.
    cache_tokens = 5 * prefix_len + concurrency * (suffix_len + output_len + BLOCK)
    results = {}
    for policy in ("prefix_aware", "pow2"):
        config = ServeArgs(model=str(tiny_model_dirs["llama"]), served_model_name=MODEL, host="127.0.0.1",
                           port=port, num_replicas=2, request_router=policy, max_seq_len=prefix_len + 64,
                           kv_cache_config=KvCacheConfig(max_tokens=cache_tokens, tokens_per_block=BLOCK))
        results[policy] = run_policy(config, prompts, output_len, concurrency, app_name=f"routing-{policy}")
    print({policy: (round(result["hit_rate"], 3), round(result["ttft_ms"]["mean"], 1))
           for policy, result in results.items()})
    routed, pow2 = results["prefix_aware"], results["pow2"]
    assert routed["failed"] == pow2["failed"] == 0, (routed["errors"], pow2["errors"])
    # Routed, each system prompt is computed about once (8 of 96 requests miss); unrouted, every replica sees all
    # eight and its cache thrashes.
    assert routed["hit_rate"] > 0.75, results
    assert routed["hit_rate"] > pow2["hit_rate"] + 0.15, results


class Clients:
    """Streaming clients that each send requests one after another until stopped; every request must stream all
    of its max_tokens tokens and end with finish_reason 'length'."""

    def __init__(self, url: str, num_clients: int, max_tokens: int, once: bool = False):
        self.url, self.max_tokens, self.once = url, max_tokens, once
        self.stop = threading.Event()
        self.completed: list[float] = []  # when each request ended
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(index,), daemon=True)
                        for index in range(num_clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, index: int) -> None:
        body = {"model": MODEL, "prompt": [1000 + index] * 8, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        while not self.stop.is_set():
            try:
                with httpx2.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as response:
                    text = "".join(response.iter_lines())
                if response.status_code != 200 or f'"completion_tokens":{self.max_tokens}' not in \
                        text.replace(" ", "") or '"finish_reason":"length"' not in text.replace(" ", ""):
                    self.failures.append(f"HTTP {response.status_code}: {text[-300:]}")
            except Exception as exc:  # a dropped stream is a failure too
                self.failures.append(repr(exc))
            self.completed.append(time.monotonic())
            if self.once:
                return

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)


def _running_engine_replicas(app_name: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app_name].deployments["RaylmEngine"]
    return deployment.replica_states.get("RUNNING", 0)


def _wait_for_replicas(app_name: str, count: int, seconds: float) -> float:
    deadline = time.monotonic() + seconds
    while _running_engine_replicas(app_name) != count:
        assert time.monotonic() < deadline, f"the engine deployment did not reach {count} replica(s) in {seconds} s"
        time.sleep(0.5)
    return time.monotonic()


def _engine_placement_groups() -> int:
    """Placement groups now created with one replica bundle and one rank bundle: the engine replicas'."""
    from ray.util import placement_group_table

    return sum(1 for group in placement_group_table().values()
               if group["state"] == "CREATED" and len(group["bundles"]) == 2)


def test_autoscaling_goes_to_two_engines_under_load_and_back_without_failing_a_request(tiny_model_dirs, port):
    app_name = "autoscaling"
    config = ServeArgs(model=str(tiny_model_dirs["llama"]), served_model_name=MODEL, host="127.0.0.1", port=port,
                       max_seq_len=4096, kv_cache_config=KvCacheConfig(max_tokens=65536),
                       autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4,
                                           "upscale_delay_s": 1, "downscale_delay_s": 2, "look_back_period_s": 2})
    server = start_server(config, app_name=app_name)
    try:
        assert _running_engine_replicas(app_name) == 1 and _engine_placement_groups() == 1
        load = Clients(server.url, num_clients=12, max_tokens=32)
        try:
            _wait_for_replicas(app_name, 2, seconds=120)
            assert _engine_placement_groups() == 2  # each engine's ranks in a placement group of its own
            served_before = len(load.completed)
            time.sleep(2)
            assert len(load.completed) > served_before  # both serve on
        finally:
            load.join()
        # Four long streams, two a replica: the load now asks for one replica, and the one removed drains its two.
        long_streams = Clients(server.url, num_clients=4, max_tokens=3500, once=True)
        scaled_down = _wait_for_replicas(app_name, 1, seconds=120)
        long_streams.join()
        assert max(long_streams.completed) > scaled_down, "the long streams ended before the scale-down: lengthen them"
        assert load.failures == [] and long_streams.failures == [], load.failures + long_streams.failures
        assert len(long_streams.completed) == 4
    finally:
        server.stop()
