"""benchmarks/robustness.py on tiny settings (slow): the fuzz finds no 5xx on any route in either mode, and
concurrent streamed requests equal their non-streamed twins with every KV block free afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "robustness.py"


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    run = subprocess.run([sys.executable, str(SCRIPT), *args, "--output_json", str(out)], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_fuzz_finds_no_server_error(tmp_path):
    pytest.importorskip("schemathesis")
    result = _run(tmp_path, "fuzz", "--max_time", "40")
    for mode in ("positive", "negative"):  # (the exit code also counts the fuzzer's own internal errors)
        run = result[mode]
        assert run["test_cases"] > 0 and run["failed"] == 0 and run["network_errors"] == 0, run["summary"]


@pytest.mark.slow
def test_concurrent_streams_match_whole_answers_and_free_every_block(tmp_path):
    result = _run(tmp_path, "load", "--clients", "16", "--requests", "32", "--max_tokens", "8")
    assert (result["requests"], result["errors"], result["mismatches"]) == (32, 0, 0)
    assert result["kv_blocks_used_after"] == 0
