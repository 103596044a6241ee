"""The OpenAI server as a Ray Serve app over the embedded SmolLM2, deployed once for the module on a local Ray
cluster in each of two layouts: the default (for one replica, the app on the engine replica behind HAProxy) and an
ingress deployment in front of the engine deployment behind Serve's proxy. The official openai client end to end,
errors, the API key, the queue bound, disconnects that free KV blocks, concurrent streams, the RL routes (device
memory released and resumed among them), and /health when the engine deployment goes down."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raylm import KvCacheConfig
from raylm.serving.config import ServeArgs
from tests.conftest import PROMPTS
from tests.serving.conftest import (
    check_long_stream_sends_only_new_parts,
    code_running_payload,
    free_port,
    listening_processes,
    openai_client,
    ray_served,
)

MODEL = "smollm2-serve"
API_KEY = "serve-test-key"
MAX_QUEUE = 24
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ALL_TAGS = ["model_weights", "kv_cache", "cuda_graph", "model"]
# Runs far longer than the tests wait, unless it is aborted.
LONG = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 300, "ignore_eos": True, "stream": True}


# ServeArgs' own defaults, and the two-deployment layout behind Serve's proxy.
LAYOUTS = {"default": {}, "deployment-serve": {"ingress": "deployment", "http_proxy": "serve"}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def config(request) -> ServeArgs:
    return ServeArgs(served_model_name=MODEL, api_key=API_KEY, max_queue=MAX_QUEUE, host="127.0.0.1",
                     port=free_port(), max_seq_len=1024, kv_cache_config=KvCacheConfig(max_tokens=8192),
                     enable_rl_endpoints=True, **LAYOUTS[request.param])


@pytest.fixture(scope="module")
def base_url(config):
    with ray_served(config, num_cpus=8) as url:
        yield url


def test_the_default_layout_is_the_app_on_the_engine_replica_behind_haproxy(config, base_url):
    from ray import serve

    listeners = listening_processes(config.port)
    deployments = set(serve.status().applications["raylm"].deployments)
    if config.ingress == "auto":
        assert listeners == {"haproxy"} and deployments == {"RaylmServer"}
    else:
        assert listeners and "haproxy" not in listeners and deployments == {"OpenAIIngress", "RaylmEngine"}


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai_client(base_url, api_key=API_KEY)


def _get(base_url: str, route: str) -> httpx2.Response:
    return httpx2.get(f"{base_url}{route}", headers=AUTH, timeout=60)


def _post(base_url: str, route: str, body: dict | bytes) -> httpx2.Response:
    if isinstance(body, bytes):
        return httpx2.post(f"{base_url}{route}", content=body, timeout=60,
                           headers={**AUTH, "content-type": "application/json"})
    return httpx2.post(f"{base_url}{route}", json=body, headers=AUTH, timeout=60)


def _used_blocks(base_url: str) -> int:
    """KV blocks in use once the engine is idle: the last iteration of a fresh one-token request."""
    _get(base_url, "/metrics")
    assert _post(base_url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200
    return _get(base_url, "/metrics").json()[-1]["kvCacheStats"]["usedNumBlocks"]


def _wait_for_free_blocks(base_url: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while _used_blocks(base_url) != 0:
        assert time.monotonic() < deadline, "an aborted request still holds KV blocks"
        time.sleep(0.2)


def test_completion_and_chat_through_the_openai_client(client):
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
    assert completion.choices[0].text.startswith(" Paris.") and completion.model == MODEL
    assert (completion.usage.completion_tokens, completion.usage.prompt_tokens) == (4, 5)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6 and chat.usage.total_tokens == chat.usage.prompt_tokens + 6
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_streamed_text_equals_non_streamed_with_a_final_usage_chunk(client):
    kwargs = dict(model=MODEL, prompt="Write a haiku about the sea:", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == whole.choices[0].text
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()

    messages = [{"role": "user", "content": "Name three colors."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    pieces = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == chat.choices[0].message.content
    usage = pieces[-1].usage  # the second run of the prompt may find it in the prefix cache
    assert (usage.prompt_tokens, usage.completion_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


@pytest.mark.slow  # ~37 s on the CI machine; test_completions checks the same stream on the in-process server
def test_a_long_streamed_completion_crosses_the_replicas_as_new_parts_only(client):
    check_long_stream_sends_only_new_parts(client, MODEL)


def test_n_two_gives_two_choices_with_their_usage(client):
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2,
                                         temperature=0.9, seed=7)
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 10
    streamed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2,
                                         temperature=0.9, seed=7, stream=True)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {choice.index: choice.text for choice in response.choices}


def test_responses_api_streamed_and_not(client):
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    assert response.status == "incomplete" and response.output_text
    assert response.usage.output_tokens == 8
    events = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0,
                                          stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == response.output_text


def test_metrics_and_prometheus_metrics_parse(client, base_url, config):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    stats = _get(base_url, "/metrics").json()
    assert stats and all({"iter", "iterLatencyMS", "numActiveRequests", "kvCacheStats"} <= set(s) for s in stats)
    families = {family.name: family for family in text_string_to_metric_families(
        _get(base_url, "/prometheus/metrics").text)}
    assert families["raylm_time_to_first_token_seconds"].type == "histogram"
    assert families["raylm_kv_cache_usage_ratio"].type == "gauge"
    assert sum(s.value for s in families["raylm_generation_tokens"].samples if s.name.endswith("_total")) >= 3
    hops = {sample.labels["hop"]: sample.value for sample in families["raylm_request_hop_seconds"].samples
            if sample.name.endswith("_count")}
    assert hops["to_engine"] >= 1  # the way to the engine, timed (its own submission when the app is on it)
    if config.ingress_layout == "deployment":
        assert hops["from_engine"] >= 1  # the way back from the engine deployment
    assert families["raylm_engine_time_to_first_token_seconds"].type == "histogram"
    info = _get(base_url, "/server_info").json()
    assert info["max_seq_len"] == 1024 and info["kv_cache"]["maxNumTokens"] == 8192


@pytest.mark.parametrize(("body", "status", "code"), [
    (b'{"model": "x", "prompt": ', 400, "invalid_json"),
    ({"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, None),
    ({"model": "gpt-4o", "prompt": "Hi", "max_tokens": 2}, 404, "model_not_found"),
    # The engine deployment finds these; they still answer 400 before any response starts.
    ({"model": MODEL, "prompt": "hello " * 1500, "max_tokens": 2}, 400, None),
    ({"model": MODEL, "prompt": "hello " * 1500, "max_tokens": 2, "stream": True}, 400, None),
    ({"model": MODEL, "prompt": [999999], "max_tokens": 2}, 400, None),
])
def test_bad_requests_answer_4xx_and_the_server_keeps_serving(client, base_url, body, status, code):
    response = _post(base_url, "/v1/completions", body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code and response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).usage.completion_tokens == 1


def _while_health_is_polled(base_url: str, route: str, body: dict) -> tuple[httpx2.Response, set[int]]:
    """Posts body to route while /health is polled; the response and every /health status seen meanwhile."""
    outcome: dict = {}
    request = threading.Thread(target=lambda: outcome.setdefault("response", _post(base_url, route, body)))
    request.start()
    statuses = set()
    while request.is_alive():
        statuses.add(httpx2.get(f"{base_url}/health", timeout=60).status_code)
        time.sleep(0.05)
    request.join()
    statuses.add(httpx2.get(f"{base_url}/health", timeout=60).status_code)
    return outcome["response"], statuses


def test_a_prompt_over_grpcs_4_mib_is_too_long_a_400_and_health_stays_200(base_url):
    body = {"model": MODEL, "prompt": "hello " * 734_000, "max_tokens": 2}  # 4.4 MB of text
    response, health = _while_health_is_polled(base_url, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "prompt has 734001 tokens; max_seq_len is 1024" in error["message"]
    assert health == {200}


def test_arguments_over_grpcs_4_mib_cross_the_replicas_as_ray_objects(base_url):
    stop = "<" + "z" * 5_000_000 + ">"  # never generated; its 5 MB go with the sampling parameters
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stop": [stop]}
    response, health = _while_health_is_polled(base_url, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(" Paris") and health == {200}


def test_every_route_but_health_needs_the_api_key(base_url):
    with pytest.raises(openai.AuthenticationError) as info:
        openai_client(base_url, api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for route in ("/v1/models", "/metrics", "/version"):
        assert httpx2.get(f"{base_url}{route}", timeout=60).status_code == 401
    assert httpx2.get(f"{base_url}/health", timeout=60).status_code == 200


def test_disconnecting_mid_stream_aborts_the_request_in_the_engine_and_frees_its_blocks(base_url):
    with httpx2.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    assert _used_blocks(base_url) > 0  # the stream holds its blocks while it runs
                    break  # leaving the iterator closes the connection
    _wait_for_free_blocks(base_url, seconds=10)  # well before LONG would end on its own


def test_many_quick_disconnects_leave_the_engine_serving_with_no_blocks_held(client, base_url):
    """Each stream is dropped at its first token, about when a short request ends on its own: cancellations
    racing the engine's own end of a request must neither leak blocks nor stall the engine."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx2.Client(timeout=30, headers=AUTH) as http:
        for _ in range(20):
            with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                next(line for line in response.iter_lines() if line.startswith("data: "))
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    _wait_for_free_blocks(base_url)


def test_a_non_streaming_client_that_gives_up_aborts_its_request(base_url):
    """Three times: behind an HAProxy that splices bodies, most such requests ran to their end (docs/benchmarks.md)."""
    for _ in range(3):
        with pytest.raises(httpx2.TimeoutException):
            httpx2.post(f"{base_url}/v1/completions", json={**LONG, "stream": False}, headers=AUTH, timeout=2.0)
        _wait_for_free_blocks(base_url, seconds=10)  # LONG runs ~30 s on a 2-core CPU unless it is aborted


def test_concurrent_streaming_clients_get_the_greedy_reference_outputs(client):
    prompts = (PROMPTS[:8] * 3)[:MAX_QUEUE]
    references = {prompt: client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                    temperature=0).choices[0].text for prompt in set(prompts)}

    async def stream_all() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=API_KEY, max_retries=0,
                                          timeout=120)

        async def one(prompt: str) -> str:
            stream = await async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                           temperature=0, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        try:
            return await asyncio.gather(*(one(prompt) for prompt in prompts))
        finally:
            await async_client.close()

    assert asyncio.run(stream_all()) == [references[prompt] for prompt in prompts]


def test_a_full_queue_answers_429_and_closing_streams_frees_it(client, base_url):
    with httpx2.Client(timeout=60, headers=AUTH, limits=httpx2.Limits(max_connections=MAX_QUEUE + 4)) as http, \
            contextlib.ExitStack() as streams:
        holders = []  # each stream's line iterator: dropping one would close its connection
        for _ in range(MAX_QUEUE):
            response = streams.enter_context(http.stream("POST", f"{base_url}/v1/completions", json=LONG))
            assert response.status_code == 200
            holders.append(response.iter_lines())
            assert next(holders[-1]).startswith("data: ")
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        assert httpx2.get(f"{base_url}/health", timeout=60).status_code == 200
    _wait_for_free_blocks(base_url)


def test_rl_routes_reach_the_engine_replica_and_its_errors_answer_400(client, base_url, tmp_path):
    assert httpx2.post(f"{base_url}/pause", timeout=60).status_code == 401
    devices = _get(base_url, "/device_ids").json()["device_ids"]
    assert len(devices) == 1 and _get(base_url, "/weight_version").json() == {"weight_version": 0}
    marker = tmp_path / "ran"
    malicious = code_running_payload(f"touch {marker}")
    response = _post(base_url, "/update_weights", {"weights": {devices[0]: malicious}})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and message.endswith("may only hold tensor handles; it refers to posix.system")
    assert "Traceback" not in message  # the worker's error, not Ray's wrapping of it
    assert not marker.exists()
    response = _post(base_url, "/update_weights", {"weights": {"another-device": "AAAA"}})
    assert response.status_code == 400 and "hold no entry for device" in response.json()["error"]["message"]
    assert _post(base_url, "/pause", {"mode": "later"}).status_code == 400
    assert _post(base_url, "/pause", {"mode": "keep"}).json() == {"paused": True, "mode": "keep"}
    assert _post(base_url, "/resume_generation", {}).json() == {"paused": False}
    assert _post(base_url, "/update_weights", {"weights": None}).json() == {"weight_version": 1}
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_memory_routes_reach_the_engine_replica_and_generation_answers_503_until_resume(client, base_url):
    greedy = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    before = client.completions.create(**greedy).choices[0].text
    try:
        assert _post(base_url, "/release", {}).json() == {"released": ALL_TAGS}
        [[rank]] = _get(base_url, "/memory_status").json()["replicas"]
        assert not any(entry["resident"] for entry in rank["tags"].values())
        response = _post(base_url, "/v1/completions", greedy)  # refused in the replica, answered by the ingress
        assert response.status_code == 503 and response.json()["error"]["code"] == "memory_released"
    finally:
        assert _post(base_url, "/resume", {}).json() == {"resumed": ALL_TAGS}
    [[rank]] = _get(base_url, "/memory_status").json()["replicas"]
    assert all(entry["resident"] for entry in rank["tags"].values())
    assert client.completions.create(**greedy).choices[0].text == before
    response = _post(base_url, "/release", {"tags": ["weights"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tags"


def test_health_is_503_once_the_engine_deployment_is_down(base_url, config):
    """Last in the module: it kills the engine replica (Serve then starts another)."""
    import ray

    if config.ingress_layout == "engine":
        pytest.skip("the app runs on the engine replica: it goes down with the engine")
    assert httpx2.get(f"{base_url}/health", timeout=60).status_code == 200
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if "RaylmEngine" in actor["name"]]
    assert len(names) == 1
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 20
    while (health := httpx2.get(f"{base_url}/health", timeout=60)).status_code != 503:
        assert time.monotonic() < deadline, "/health still answers 200 with the engine deployment down"
        time.sleep(0.2)
    message = health.json()["error"]["message"]  # short: what Ray said of the dead replica is only in the log
    assert message.startswith("the engine is not running (request id ") and "actor" not in message.lower()
    response = _post(base_url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable"
