"""Server errors: the client gets a short message with a request id, streamed or not, while what Ray says about
the failure (actor ids, pids, namespace, node address) goes only to the server log under that id."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import httpx2
import pytest

from raylm import CompletionOutput, RequestError
from raylm.serving import ServingConfig, build_app
from raylm.serving.engine_stream import OutputChunk
from tests.serving.conftest import MODEL, serve

# What a dead Ray actor's error says about it.
RAY_DETAILS = ("ActorDiedError: The actor died unexpectedly. actor_id=5b3d0c7e01000000, pid=48213, ip=10.1.2.3, "
               "namespace=serve, name=SERVE_REPLICA::raylm#EngineDeployment#abc")
LEAKS = ("5b3d0c7e01000000", "48213", "10.1.2.3", "namespace", "SERVE_REPLICA", "ActorDiedError")
REQUEST_ID = re.compile(r"request id (\S+?);")


class FailingStream:
    """A request that fails after its first chunk, with Ray's words."""

    async def admitted(self):
        pass

    async def __aiter__(self):
        yield OutputChunk("0", finished=False, num_cached_tokens=0, metrics={}, prompt="Hi", prompt_token_ids=[1, 2],
                          completions=[CompletionOutput(0, text="Hel", token_ids=[3])], first=True)
        raise RequestError(f"engine worker 0 died: {RAY_DETAILS}")

    def abort(self):
        pass


class FailingEngine:
    """Just the ServingEngine build_app needs: every request fails after its first output, and /server_info's
    capacity call raises."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.info = SimpleNamespace(max_seq_len=1024, pooling=None)  # a generating engine
        self.dead_reason = None
        self.startup_metrics = {}

    def stream(self, inputs, sampling_params, priority, cache_salt, each_step=True, lora_request=None):
        return FailingStream()

    def get_kv_cache_capacity(self):
        raise RuntimeError(f"ray.get failed: {RAY_DETAILS}")


@pytest.fixture(scope="module")
def failing_url(llm):
    engine = FailingEngine(llm.tokenizer)
    with serve(build_app(engine, ServingConfig(served_model_name=MODEL))) as url:
        yield url, engine


def _logged_under(caplog, request_id: str) -> str:
    """The server log's records that name request_id, with their tracebacks."""
    return "\n".join(record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
                     for record in caplog.records if request_id in record.getMessage())


def _check_short(message: str, caplog) -> str:
    """message leaks nothing of Ray's, names a request id, and the log holds the details under that id."""
    assert not [leak for leak in LEAKS if leak in message], message
    request_id = REQUEST_ID.search(message).group(1)
    assert "10.1.2.3" in _logged_under(caplog, request_id)
    return request_id


def test_a_failed_request_answers_a_short_500_with_its_response_id(failing_url, caplog):
    url, _ = failing_url
    caplog.set_level(logging.ERROR)
    for route, body in [("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
        response = httpx2.post(f"{url}{route}", json={"model": MODEL, "max_tokens": 4, **body})
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["message"].startswith("generation failed")
        assert _check_short(error["message"], caplog).startswith(("cmpl-", "chatcmpl-"))


def test_a_failed_stream_ends_in_a_short_error_event(failing_url, caplog):
    url, _ = failing_url
    caplog.set_level(logging.ERROR)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}
    with httpx2.stream("POST", f"{url}/v1/completions", json=body) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == "Hel"
    request_id = _check_short(json.loads(lines[-2].removeprefix("data: "))["error"]["message"], caplog)
    assert lines[-1] == "data: [DONE]" and request_id == json.loads(lines[0].removeprefix("data: "))["id"]

    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True}
    with httpx2.stream("POST", f"{url}/v1/responses", json=body) as streamed:
        events = [json.loads(line.removeprefix("data: ")) for line in streamed.iter_lines() if line.startswith("data:")]
    assert events[-1]["type"] == "error"
    _check_short(events[-1]["message"], caplog)


def test_an_unexpected_exception_answers_a_short_500(failing_url, caplog):
    url, _ = failing_url
    caplog.set_level(logging.ERROR)
    response = httpx2.get(f"{url}/server_info")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "/server_info" in error["message"]
    _check_short(error["message"], caplog)


def test_a_dead_engine_answers_a_short_503(failing_url, caplog, monkeypatch):
    url, engine = failing_url
    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(engine, "dead_reason", f"engine worker 0 died: {RAY_DETAILS}")
    for response in (httpx2.get(f"{url}/health"),
                     httpx2.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})):
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and error["message"].startswith("the engine is not running")
        _check_short(error["message"], caplog)
