"""Every example in examples/ runs on the CPU with tiny settings (the RL loop's own test is slow:
tests/rl_api/test_rl_loop_example.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str) -> str:
    run = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_quickstart_generates_for_each_prompt_greedy_and_sampled():
    out = _run("quickstart.py", "--max_tokens", "4")
    assert out.count("->") == 6


def test_chat_carries_the_conversation_over_three_turns():
    out = _run("chat.py", "--max_tokens", "8")
    assert out.count("user:") == 3 and out.count("assistant:") == 3


def test_async_generate_streams_concurrently_and_cancels_the_long_request():
    out = _run("async_generate.py", "--max_tokens", "8", "--cancel_after", "0.5")
    assert "cancelled after" in out and out.count("  '") == 3


@pytest.mark.timeout(900)
def test_batch_infer_answers_table_rows_and_openai_requests():
    out = _run("batch_infer.py", "--max_tokens", "4")
    assert "4 rows answered (0 with errors" in out
    for key in ("capital", "colour", "request-1", "request-2"):
        assert f"{key}: " in out
