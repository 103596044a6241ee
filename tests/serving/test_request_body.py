"""Large request bodies against the in-process app: the 413 beyond max_request_body_bytes, and long inputs that are
parsed and tokenized while /health keeps answering at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx2
import pytest

from raylm.serving import LocalEngine, ServingConfig, build_app
from tests.serving.conftest import MODEL, serve

BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small_limit_url(llm) -> Iterator[str]:
    config = ServingConfig(served_model_name=MODEL, max_request_body_bytes=BODY_LIMIT)
    with serve(build_app(LocalEngine(llm), config)) as url:
        yield url


def _health_latencies_while(work: threading.Thread, base_url: str) -> list[float]:
    """Polls /health until `work` ends; the seconds each answer took (each must be a 200)."""
    latencies = []
    while work.is_alive():
        start = time.monotonic()
        assert httpx2.get(f"{base_url}/health", timeout=60).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.02)
    return latencies


def _in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        start = time.monotonic()
        outcome["response"] = call()
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_body_over_the_limit_answers_413_in_openai_shape_and_health_stays_200(small_limit_url):
    body = {"model": MODEL, "prompt": "hello " * BODY_LIMIT, "max_tokens": 1}
    response = httpx2.post(f"{small_limit_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert f"limit of {BODY_LIMIT} bytes (max_request_body_bytes)" in error["message"]
    assert httpx2.get(f"{small_limit_url}/health", timeout=60).status_code == 200


def test_a_streamed_body_without_a_length_answers_413_once_it_passes_the_limit(small_limit_url):
    def chunks() -> Iterator[bytes]:
        yield f'{{"model": "{MODEL}", "prompt": "'.encode()
        for _ in range(2 * BODY_LIMIT // 1024):
            yield b"x" * 1024
        yield b'"}'

    response = httpx2.post(f"{small_limit_url}/tokenize", content=chunks(), timeout=60,
                           headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert httpx2.post(f"{small_limit_url}/tokenize", json={"prompt": "hello"}, timeout=60).status_code == 200


def test_health_answers_at_once_while_a_long_text_is_tokenized(base_url):
    body = {"prompt": "hello " * 400_000}  # 2.4 MB: seconds of tokenizing
    tokenize, outcome = _in_thread(lambda: httpx2.post(f"{base_url}/tokenize", json=body, timeout=120))
    latencies = _health_latencies_while(tokenize, base_url)
    tokenize.join()
    assert outcome["response"].status_code == 200 and outcome["response"].json()["count"] == 400_001
    assert len(latencies) >= 3 and max(latencies) < outcome["seconds"] / 3, (latencies, outcome["seconds"])


def test_a_prompt_too_long_for_max_seq_len_answers_400_while_health_answers_at_once(base_url):
    body = {"model": MODEL, "prompt": "hello " * 400_000, "max_tokens": 1}
    completion, outcome = _in_thread(lambda: httpx2.post(f"{base_url}/v1/completions", json=body, timeout=120))
    latencies = _health_latencies_while(completion, base_url)
    completion.join()
    response = outcome["response"]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "prompt has 400001 tokens; max_seq_len is 1024" in error["message"]
    assert len(latencies) >= 3 and max(latencies) < outcome["seconds"] / 3, (latencies, outcome["seconds"])


def test_a_large_body_is_validated_in_a_thread_with_the_same_errors(base_url):
    prompts = ["hello there"] * 40_000  # 600 KB: parsed off the event loop
    response = httpx2.post(f"{base_url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prompts, "max_tokens": "ten"})
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == ("max_tokens", "invalid_value")
    broken = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * 600_000
    response = httpx2.post(f"{base_url}/v1/completions", content=broken, timeout=60,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
