"""`raylm serve`: flags, --config and --set in their order of precedence, errors before anything starts,
--print_schema, and one real server in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2
import openai

from raylm.cli import build_parser, main, serve_flag_values
from raylm.serving.config import SCHEMA_PATH
from raylm.serving.config_sources import layer_serve_args
from tests.serving.conftest import free_port, listening_processes, wait_until_serving


def _layered(argv: list[str]):
    args = build_parser().parse_args(["serve", *argv])
    return layer_serve_args(args.config_file, serve_flag_values(args), args.assignments)


def test_defaults_then_config_then_flags_then_set_whatever_the_order(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("max_batch_size: 8\nmax_seq_len: 512\nport: 9001\n"
                      "kv_cache_config:\n  max_tokens: 2048\n  tokens_per_block: 16\n")
    args = _layered(["--set", "max_seq_len=640", "--max_seq_len", "768", "--config", str(config),
                     "--kv_cache_free_gpu_memory_fraction", "0.5", "--tp_size", "2", "--trust_remote_code"])
    assert args.max_batch_size == 8 and args.port == 9001  # from the file only
    assert args.max_seq_len == 640  # file < flag < --set
    assert (args.kv_cache_config.max_tokens, args.kv_cache_config.tokens_per_block) == (2048, 16)
    assert args.kv_cache_config.free_gpu_memory_fraction == 0.5  # a flag sets one field of a file's mapping
    assert args.tensor_parallel_size == 2 and args.trust_remote_code is True
    assert args.max_num_tokens == 8192 and args.host == "localhost"  # untouched defaults
    assert _layered(["my-model"]).model_name == "my-model"


def test_the_extra_llm_api_options_alias_and_api_key_from_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("served_model_name: from-file\n")
    monkeypatch.setenv("RAYLM_API_KEY", "from-env")
    args = _layered(["--extra_llm_api_options", str(config)])
    assert args.served_model_name == "from-file" and args.api_key == "from-env"
    assert _layered(["--api_key", "from-flag"]).api_key == "from-flag"


def test_the_rl_endpoints_are_off_unless_the_flag_or_the_config_turns_them_on(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("enable_rl_endpoints: true\n")
    assert _layered([]).enable_rl_endpoints is False
    assert _layered(["--enable_rl_endpoints"]).serving_config().enable_rl_endpoints is True
    assert _layered(["--config", str(config)]).enable_rl_endpoints is True


def test_bad_configuration_exits_2_before_starting_anything(tmp_path, capsys):
    assert main(["serve", "--set", "kv_cache_config.max_token=4096"]) == 2
    error = capsys.readouterr().err
    assert "unknown config path 'kv_cache_config.max_token'" in error and "kv_cache_config.max_tokens" in error
    assert main(["serve", "--set", "model=other"]) == 2
    assert "MODEL argument" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text("max_batch_size: 0\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "max_batch_size: Input should be greater than or equal to 1 (got 0)" in capsys.readouterr().err
    assert main(["serve", "/no/such/model/dir"]) == 2
    assert "not an existing directory" in capsys.readouterr().err


def test_print_schema_prints_the_shipped_schema(capsys):
    assert main(["serve", "--print_schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(SCHEMA_PATH.read_text())


def test_without_the_serve_extra_raylm_serve_says_how_to_install_it():
    code = "import sys; sys.modules['fastapi'] = None\nfrom raylm.cli import main\nsys.exit(main(['serve']))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "the server needs the 'serve' extra, which lacks fastapi" in run.stderr
    assert 'pip install -e ".[serve]"' in run.stderr


def test_raylm_serve_runs_a_server_until_terminated(tmp_path):
    port = free_port()
    config = tmp_path / "config.yaml"
    # The defaults for one model on one replica: the app on the engine replica, HAProxy on the port
    config.write_text(f"served_model_name: from-file\nmax_seq_len: 512\nhost: 127.0.0.1\nport: {port}\n"
                      "kv_cache_config:\n  max_tokens: 4096\n")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAYLM_API_KEY"] = "cli-key"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "raylm.cli", "serve", "--config", str(config), "--max_seq_len", "768",
               "--served_model_name", "from-flag", "--set", "served_model_name=from-set"]
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_serving(base_url, process, log)
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="cli-key", max_retries=0, timeout=120)
        models = client.models.list().data
        assert [model.id for model in models] == ["from-set"] and models[0].model_extra["max_model_len"] == 768
        completion = client.completions.create(model="from-set", prompt="The capital of France is", max_tokens=3,
                                               temperature=0)
        assert completion.choices[0].text.startswith(" Paris")
        assert listening_processes(port) == {"haproxy"}
        chunks = list(client.completions.create(model="from-set", prompt="The capital of France is", max_tokens=6,
                                                temperature=0, stream=True))
        assert sum(bool(chunk.choices[0].text) for chunk in chunks) >= 2  # streamed through HAProxy, not buffered
        assert "".join(chunk.choices[0].text for chunk in chunks).startswith(completion.choices[0].text)
        bad = httpx2.post(f"{base_url}/v1/completions", json={"model": "from-set", "prompt": "Hi", "max_tokens": -1},
                          headers={"Authorization": "Bearer cli-key"}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        # The app answers as soon as it runs; serve.run returns (and the CLI says where) once the controller saw it.
        served = f"is served at http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 30
        while served not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served in log.read_text()
        console = log.read_text()
        assert "raylm serve: starting a local Ray cluster..." in console and "raylm serve: loading from-set" in console
        assert "(HTTP on the engine replica, HAProxy on the port)" in console
        assert " INFO " not in console  # Ray's and Serve's INFO lines stay out below --log_level info
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, log.read_text()[-3000:]


def test_a_port_in_use_fails_in_one_line_before_ray_starts(tiny_model_dirs, monkeypatch, capsys):
    import ray

    def no_ray(*_):
        raise AssertionError("Ray was started although the port is taken")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("raylm.actors.ray_executor.ensure_ray", no_ray)
    assert not ray.is_initialized()
    with socket.socket() as listener:  # bound as Serve's proxy binds, SO_REUSEPORT included
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = main(["serve", str(tiny_model_dirs["llama"]), "--host", "127.0.0.1", "--port", str(port)])
    error = capsys.readouterr().err
    assert code == 1 and error.count("\n") == 1
    assert f"port {port} is in use on 127.0.0.1" in error
