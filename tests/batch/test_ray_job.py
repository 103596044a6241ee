"""`ray job submit -- python -m raylm.cli batch ...` runs a batch job unchanged on a Ray cluster: a one-node cluster
of its own (`ray start --head --block`, ended by signalling its process group), the repository as the job's
working directory."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
# What the job's working-directory upload leaves out (.gitignore'd paths are left out too).
EXCLUDES = ["**/.git", "**/.venv", "benchmarks/results", "**/__pycache__", "**/.pytest_cache", "**/.ruff_cache"]


def _free_ports(count: int) -> list[int]:
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _wait_for_job_server(url: str, head: subprocess.Popen, environment: dict, timeout_s: float = 120) -> None:
    """Waits until the job server answers `ray job list`."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert head.poll() is None, f"ray start exited with {head.returncode}"
        listed = subprocess.run([RAY, "job", "list", "--address", url], env=environment, capture_output=True,
                                text=True, timeout=60)
        if listed.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no job server at {url} after {timeout_s} s: {listed.stderr[-2000:]}")
        time.sleep(1)


def _stop(head: subprocess.Popen, temp_dir: str) -> None:
    """Ends this test's cluster only (`ray stop` would end every Ray cluster on the machine): its head's process
    group at once (a throwaway cluster needs no draining), then any of its processes, found by its temp dir, that
    left the group."""
    import psutil

    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait(timeout=30)
    for process in psutil.process_iter(["cmdline"]):
        if any(temp_dir in part for part in process.info["cmdline"] or ()):
            try:
                process.kill()
            except psutil.Error:
                pass


@pytest.fixture
def job_server(tmp_path):
    """A one-node Ray cluster on free ports; yields its job server's address."""
    temp_dir = tempfile.mkdtemp(prefix="raylm-job-", dir="/tmp")  # short: Ray's socket paths must fit
    gcs, dashboard, agent, agent_grpc, client, metrics, env_agent = _free_ports(7)
    # Ray's token authentication with a token of this cluster's own, which `ray job submit` sends too; the
    # entrypoint's `python` is this interpreter.
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    environment.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "ray-start.log", "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus", "2", "--temp-dir", temp_dir, "--port", str(gcs),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--include-dashboard", "true",
         "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
         "--ray-client-server-port", str(client), "--metrics-export-port", str(metrics),
         "--runtime-env-agent-port", str(env_agent), "--disable-usage-stats"],
        env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_job_server(url, head, environment)
        yield url, environment
    finally:
        _stop(head, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_runs_a_batch_job_unchanged(job_server, tiny_model_dirs, tmp_path):
    url, environment = job_server
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"Row {i} says"}) + "\n" for i in range(6)))
    output = tmp_path / "answers"
    submitted = subprocess.run(
        [RAY, "job", "submit", "--address", url, "--working-dir", str(REPO),
         "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--",
         "python", "-m", "raylm.cli", "batch", "-i", str(rows), "-o", str(output),
         "--model", str(tiny_model_dirs["llama"]), "--max_tokens", "4", "--temperature", "0",
         "--set", "max_seq_len=128"],
        env=environment, capture_output=True, text=True, timeout=480)
    assert submitted.returncode == 0, submitted.stdout[-4000:] + submitted.stderr[-4000:]
    assert "succeeded" in submitted.stdout.lower()
    assert "raylm batch: 6 rows answered (0 with errors" in submitted.stdout
    answers = [json.loads(line) for file in output.glob("*.jsonl") for line in file.read_text().splitlines()]
    assert sorted(answer["row_id"] for answer in answers) == [str(i) for i in range(6)]
    assert all(answer["num_generated_tokens"] == 4 and answer["error"] is None for answer in answers)
