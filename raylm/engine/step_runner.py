"""What the engine core asks of whatever runs its steps: one device's ModelRunner (engine/model_runner.py) or a
multi-rank engine's DistributedRunner (actors/distributed_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from raylm.engine.messages import TokenLogprob
from raylm.engine.sampler import SampleResult
from raylm.engine.scheduler import SchedulerOutput


@dataclass
class ModelOutput:
    """A step's results: one draw per scheduled sequence that completed, and the prompt log-probabilities."""

    samples: list[SampleResult | None]  # aligned with SchedulerOutput.scheduled
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


class RanksOutOfStep(RuntimeError):
    """A step failed on rank 0 after its plan had gone to the other ranks, which ran (or wait in) a step that
    rank 0 did not finish: their collectives no longer pair up with rank 0's, so the engine stops with this error
    instead of failing the step's requests and going on (as one rank does)."""


class StepRunner(Protocol):
    """Runs the engine's steps. With `can_overlap`, `launch` queues a step without waiting for the device (input
    tokens that are placeholders come from `previous`, the step still in flight) and `collect` waits for its
    results; otherwise `execute` runs a step to the end. `pipelined` runners overlap steps of different sequences
    (the scheduler then keeps sequences whose draw is in flight out of the next step)."""

    device: torch.device
    can_overlap: bool
    pipelined: bool

    def launch(self, out: SchedulerOutput, previous: object | None = None) -> object: ...

    def collect(self, launched: object) -> ModelOutput: ...

    def execute(self, out: SchedulerOutput) -> ModelOutput: ...
