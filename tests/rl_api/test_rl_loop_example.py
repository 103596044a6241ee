"""examples/rl_loop.py runs: one iteration of rollouts, training and refit, the logprob gap at float precision."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


@pytest.mark.slow
def test_the_rl_loop_example_refits_exactly():
    # RAY_ADDRESS=local: the example's ray.init starts a cluster of its own rather than joining another process's.
    run = subprocess.run([sys.executable, str(EXAMPLE), "--iterations", "2", "--samples", "2", "--train_steps", "1"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_ADDRESS": "local"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split() for line in run.stdout.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert [row[-1] for row in rows] == ["1", "2"]  # the weight version after each refit
    assert all(float(row[-2]) < 1e-4 for row in rows)  # the largest trainer / engine logprob gap
