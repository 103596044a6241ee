"""The bound on requests in flight (429) and the API key (401), each on an app of its own over one engine."""

from __future__ import annotations

import time

import httpx2
import openai
import pytest

from raylm.serving import LocalEngine, ServingConfig, build_app
from tests.serving.conftest import MODEL, openai_client, serve

LONG = dict(model=MODEL, prompt="Count to one thousand:", max_tokens=600, extra_body={"ignore_eos": True})


def test_requests_beyond_max_queue_get_429_until_a_slot_frees(llm):
    with serve(build_app(LocalEngine(llm), ServingConfig(served_model_name=MODEL, max_queue=1))) as url:
        client = openai_client(url)
        holder = client.completions.create(stream=True, **LONG)
        next(iter(holder))  # the one slot is taken while this stream is open
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=1)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert client.models.list().data[0].id == MODEL  # only generation routes count
        assert httpx2.get(f"{url}/health").status_code == 200
        holder.close()  # disconnecting frees the slot
        deadline = time.monotonic() + 20
        while True:
            try:
                assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).choices
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the slot was not freed after the client disconnected"
                time.sleep(0.1)


def test_api_key_is_required_on_every_route_but_health(llm):
    with serve(build_app(LocalEngine(llm), ServingConfig(served_model_name=MODEL, api_key="sesame"))) as url:
        with pytest.raises(openai.AuthenticationError) as info:
            openai_client(url, api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        for route in ("/v1/models", "/metrics", "/prometheus/metrics", "/version", "/server_info"):
            response = httpx2.get(f"{url}{route}")
            assert response.status_code == 401 and set(response.json()["error"]) == {"message", "type", "param",
                                                                                       "code"}
        assert httpx2.get(f"{url}/health").status_code == 200
        client = openai_client(url, api_key="sesame")
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
        assert httpx2.get(f"{url}/version", headers={"Authorization": "Bearer sesame"}).status_code == 200
