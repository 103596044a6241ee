"""The RL routes (raylm/serving/rl_routes.py) over an AsyncLLM in this process on the tiny llama: absent unless
enabled, behind the API key, pause(abort) ending a running request, weights sent as base64 payloads changing the
greedy output and a finalize bumping the weight version, device memory released (generation answering 503 until
it is resumed, with the same greedy output after) and bad input (a payload that would run code among it, an
unknown memory tag) answering 400 with the weights and memory unchanged."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx2
import pytest

from raylm import LLM, AsyncLLM, KvCacheConfig
from raylm.rl_api.weight_transfer import encode_payload, pack_bucket
from raylm.serving import LocalEngine, ServingConfig, build_app
from tests.conftest import hf_model, perturbed_hf_model
from tests.serving.conftest import code_running_payload, serve

MODEL = "tiny-rl"
API_KEY = "trainer-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTES = [("POST", "/pause"), ("POST", "/resume_generation"), ("POST", "/update_weights"),
          ("GET", "/weight_version"), ("GET", "/device_ids"), ("POST", "/release"), ("POST", "/resume"),
          ("GET", "/memory_status")]
ALL_TAGS = ["model_weights", "kv_cache", "cuda_graph", "model"]
PROMPT = [5, 17, 99, 3, 250, 7, 42, 8]
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16)


@pytest.fixture(scope="module")
def async_llm(tiny_model_dirs) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(model=str(tiny_model_dirs["llama"]), executor="local", kv_cache_config=KV, max_seq_len=1024)
    asyncio.run(llm.setup_async())
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(async_llm) -> Iterator[str]:
    config = ServingConfig(served_model_name=MODEL, api_key=API_KEY, enable_rl_endpoints=True)
    with serve(build_app(LocalEngine(async_llm), config)) as base_url:
        yield base_url


def _call(base_url: str, method: str, route: str, body: dict | None = None,
          headers: dict | None = None) -> httpx2.Response:
    return httpx2.request(method, f"{base_url}{route}", json=body, headers=AUTH if headers is None else headers,
                          timeout=60)


def _post(base_url: str, route: str, body: dict | None = None) -> httpx2.Response:
    response = _call(base_url, "POST", route, body)
    assert response.status_code == 200, response.text
    return response


def _error(response: httpx2.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _greedy_text(base_url: str) -> str:
    return _post(base_url, "/v1/completions", GREEDY).json()["choices"][0]["text"]


def _weight_version(base_url: str) -> int:
    return _call(base_url, "GET", "/weight_version").json()["weight_version"]


def _device(base_url: str) -> str:
    devices = _call(base_url, "GET", "/device_ids").json()["device_ids"]
    assert len(devices) == 1
    return devices[0]


def _memory_tags(base_url: str) -> dict[str, dict]:
    """The one rank's memory status by tag: {tag: {"bytes", "resident"}}."""
    [[rank]] = _call(base_url, "GET", "/memory_status").json()["replicas"]
    return rank["tags"]


def _payload(named_tensors) -> tuple[object, str]:
    """A bucket of the tensors and its base64 payload; keep the bucket alive until the update returns."""
    bucket = pack_bucket(named_tensors)
    return bucket, encode_payload(bucket.payload())


def test_rl_routes_are_404_unless_enabled(async_llm):
    with serve(build_app(LocalEngine(async_llm), ServingConfig(served_model_name=MODEL))) as base_url:
        for method, route in ROUTES:
            assert _error(_call(base_url, method, route, {"weights": None}), 404)["message"] == "Not Found"


def test_rl_routes_need_the_api_key(url):
    for method, route in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = _error(_call(url, method, route, {"weights": None}, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
    assert _weight_version(url) >= 0  # with the key


def test_device_ids_are_the_engine_ranks_ids(url, async_llm):
    assert [_device(url)] == asyncio.run(async_llm.collective_rpc("report_device_id"))


@contextmanager
def _running_stream(url: str) -> Iterator[Iterator[str]]:
    """A long streamed greedy completion, its lines once its first chunk has come (the request runs)."""
    long = {**GREEDY, "max_tokens": 900, "stream": True}
    with httpx2.Client(timeout=60, headers=AUTH) as http, \
            http.stream("POST", f"{url}/v1/completions", json=long) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        yield lines


def test_pause_abort_ends_a_running_request_and_resume_lets_requests_run(url):
    try:
        with _running_stream(url) as lines:
            assert _post(url, "/pause", {"mode": "abort"}).json() == {"paused": True, "mode": "abort"}
            chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    finally:
        assert _post(url, "/resume_generation").json() == {"paused": False}
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("abort", "generation paused")
    assert len(chunks) < 900
    assert _greedy_text(url)  # generating again


def test_pause_without_a_body_aborts_and_keep_parks_until_resume(url):
    try:
        assert _post(url, "/pause").json() == {"paused": True, "mode": "abort"}
        assert _post(url, "/pause", {"mode": "keep"}).json() == {"paused": True, "mode": "keep"}
    finally:
        _post(url, "/resume_generation")
    assert _greedy_text(url)


def test_updated_weights_change_the_greedy_output_and_the_finalize_bumps_the_version(url, tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    _, perturbed = perturbed_hf_model(path)
    original = [(name, param.detach().clone()) for name, param in
                hf_model(path).named_parameters(remove_duplicate=False)]
    device, version, before = _device(url), _weight_version(url), _greedy_text(url)

    bucket, payload = _payload(perturbed)
    try:
        _post(url, "/pause")
        assert _post(url, "/update_weights", {"weights": {device: payload}}).json() == {"weight_version": version}
        assert _weight_version(url) == version  # new weights, not yet a new version
        assert _post(url, "/update_weights", {"weights": None}).json() == {"weight_version": version + 1}
    finally:
        _post(url, "/resume_generation")
    del bucket
    assert _weight_version(url) == version + 1
    assert _greedy_text(url) != before

    bucket, payload = _payload(original)  # not paused and nothing running: the engine pauses around it
    _post(url, "/update_weights", {"weights": {device: payload}})
    _post(url, "/update_weights", {"weights": None})
    assert _weight_version(url) == version + 2 and _greedy_text(url) == before


def test_a_payload_that_would_run_code_is_400_and_leaves_the_weights(url, tmp_path):
    marker = tmp_path / "ran"
    device, version, before = _device(url), _weight_version(url), _greedy_text(url)
    malicious = code_running_payload(f"touch {marker}")
    error = _error(_call(url, "POST", "/update_weights", {"weights": {device: malicious}}), 400)
    assert "may only hold tensor handles" in error["message"] and "system" in error["message"]
    assert error["param"] == "weights"
    assert not marker.exists()
    assert _weight_version(url) == version and _greedy_text(url) == before


def test_release_answers_generation_503_until_resume_brings_back_the_same_greedy_output(url):
    before, resident = _greedy_text(url), _memory_tags(url)
    assert set(resident) == set(ALL_TAGS) and all(entry["resident"] for entry in resident.values())
    assert resident["model_weights"]["bytes"] > 0 and resident["kv_cache"]["bytes"] > 0
    try:
        assert _post(url, "/release").json() == {"released": ALL_TAGS}  # no body: every tag
        assert _post(url, "/release", {"tags": ALL_TAGS}).json() == {"released": ALL_TAGS}  # again: nothing to do
        released = _memory_tags(url)
        assert not any(entry["resident"] for entry in released.values())
        assert {tag: entry["bytes"] for tag, entry in released.items()} == \
               {tag: entry["bytes"] for tag, entry in resident.items()}  # what each holds when resident
        for body in (GREEDY, {**GREEDY, "stream": True}):
            error = _error(_call(url, "POST", "/v1/completions", body), 503)
            assert error["code"] == "memory_released" and "POST /resume" in error["message"]
            assert "['model_weights', 'kv_cache', 'model']" in error["message"]
        assert "resume" in _error(_call(url, "POST", "/resume_generation"), 400)["message"]
    finally:
        assert _post(url, "/resume", {}).json() == {"resumed": ALL_TAGS}  # no tags: every tag
    assert _post(url, "/resume").json() == {"resumed": ALL_TAGS}  # again: nothing to do
    assert _memory_tags(url) == resident
    assert _greedy_text(url) == before


def test_only_the_released_tags_generation_needs_refuse_it(url):
    before = _greedy_text(url)
    try:
        assert _post(url, "/release", {"tags": ["cuda_graph"]}).json() == {"released": ["cuda_graph"]}
        assert _greedy_text(url) == before  # decode steps run eagerly
        assert _post(url, "/release", {"tags": ["kv_cache", "kv_cache"]}).json() == {"released": ["kv_cache"]}
        error = _error(_call(url, "POST", "/v1/completions", GREEDY), 503)
        assert "['kv_cache']" in error["message"]
        assert {tag for tag, entry in _memory_tags(url).items() if not entry["resident"]} == {"cuda_graph", "kv_cache"}
    finally:
        _post(url, "/resume")
    assert _greedy_text(url) == before


def test_release_while_a_request_runs_unpaused_is_400_and_frees_nothing(url):
    try:
        with _running_stream(url) as lines:
            error = _error(_call(url, "POST", "/release", {"tags": ["kv_cache"]}), 400)
            assert "while requests run" in error["message"] and "pause_generation" in error["message"]
            assert all(entry["resident"] for entry in _memory_tags(url).values())
            assert next(line for line in lines if line.startswith("data: {"))  # still generating
            _post(url, "/pause")  # ends it, its last output delivered
    finally:
        _post(url, "/resume_generation")
    assert _greedy_text(url)


@pytest.mark.parametrize(("payload", "message"), [
    ("not base64!", "must be base64 text"),
    ("", "could not be unpickled"),
    (base64.b64encode(b"\x80\x05garbage").decode("ascii"), "could not be unpickled"),
])
def test_a_payload_that_is_no_pickle_of_handles_is_400(url, payload, message):
    error = _error(_call(url, "POST", "/update_weights", {"weights": {_device(url): payload}}), 400)
    assert message in error["message"] and error["param"] == "weights"


@pytest.mark.parametrize(("route", "body", "param", "message"), [
    ("/pause", {"mode": "later"}, "mode", "Input should be 'abort' or 'keep'"),
    ("/pause", {"mode": "abort", "when": "now"}, "when", "Unrecognized request argument"),
    ("/update_weights", {}, "weights", "weights is required"),
    ("/update_weights", {"weights": {"gpu-0": 5}}, "weights", "got int for device 'gpu-0'"),
    ("/update_weights", {"weights": {"gpu-0": {"bucket": []}}}, "weights", "got dict for device 'gpu-0'"),
    ("/update_weights", {"weights": ["gpu-0"]}, "weights", "must map device ids to base64 payloads"),
    ("/update_weights", {"weights": {"another-device": "AAAA"}}, "weights", "hold no entry for device"),
    ("/release", {"tags": ["kv_cache", "weights"]}, "tags",
     "unknown memory tags ['weights']; tags are ['model_weights', 'kv_cache', 'cuda_graph', 'model']"),
    ("/resume", {"tags": ["gpu"]}, "tags", "unknown memory tags ['gpu']"),
    ("/release", {"tags": "kv_cache"}, "tags", "Input should be a valid list"),
    ("/resume", {"tags": None}, "tags", "Input should be a valid list"),
    ("/release", {"tags": ["kv_cache"], "level": 1}, "level", "Unrecognized request argument"),
])
def test_bad_input_is_400_naming_the_problem(url, route, body, param, message):
    error = _error(_call(url, "POST", route, body), 400)
    assert message in error["message"] and error["param"] == param
    assert all(entry["resident"] for entry in _memory_tags(url).values())


def test_an_engine_without_rl_control_answers_501(tiny_model_dirs):
    config = ServingConfig(served_model_name=MODEL, enable_rl_endpoints=True)
    with LLM(model=str(tiny_model_dirs["llama"]), kv_cache_config=KV, max_seq_len=256) as llm, \
            serve(build_app(LocalEngine(llm), config)) as base_url:
        for method, route in (("GET", "/device_ids"), ("POST", "/release"), ("GET", "/memory_status")):
            error = _error(_call(base_url, method, route), 501)
            assert "need an AsyncLLM" in error["message"]
