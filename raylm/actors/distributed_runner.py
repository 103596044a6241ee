"""The multi-rank step: rank 0's DistributedRunner, which the engine core steps as it would one device's
ModelRunner, and the other ranks' worker_loop.

Rank 0 hosts the engine. Each step it sends the plan to every rank (actors/transport.py), runs its own stage, and
under pipeline parallelism receives the logits from the last stage; the other ranks receive the plan, run their
stage and pass activations on. With one pipeline stage steps overlap as on one device; pipelines overlap
consecutive steps of different sequences, or (disable_pipeline_overlap) run each step in micro-batches.
"""

from __future__ import annotations

import bisect
import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylm.actors.transport import Communicator, Sending
from raylm.engine.model_runner import LaunchedStep, ModelRunner
from raylm.engine.sampler import row_index
from raylm.engine.scheduler import SchedulerOutput
from raylm.engine.step_plan import StepPlan, plan_step
from raylm.engine.step_runner import ModelOutput, RanksOutOfStep


def split_schedule(out: SchedulerOutput, parts: int) -> list[SchedulerOutput]:
    """Contiguous slices of the schedule, one per pipeline micro-batch (fewer if there are fewer sequences),
    cut where the running token count passes each equal share: a step of decodes and prefill chunks gives each
    micro-batch about the same number of tokens (a stage's time grows with its tokens), not the same number of
    sequences, which put every prefill chunk (they follow the decodes) into the last micro-batch."""
    items = out.scheduled
    parts = max(1, min(parts, len(items)))
    prefix = list(itertools.accumulate((item.num_tokens for item in items), initial=0))
    bounds = [0]
    for part in range(1, parts):
        share = prefix[-1] * part / parts
        cut = bisect.bisect_left(prefix, share)
        if cut > 0 and share - prefix[cut - 1] <= prefix[min(cut, len(items))] - share:
            cut -= 1  # the earlier boundary is at least as close to the share
        bounds.append(min(max(cut, bounds[-1] + 1), len(items) - (parts - part)))  # every slice non-empty
    bounds.append(len(items))
    slices = []
    for index in range(parts):
        chunk = items[bounds[index] : bounds[index + 1]]
        piece = SchedulerOutput(decodes=[i for i in chunk if i.num_tokens == 1],
                                prefills=[i for i in chunk if i.num_tokens > 1])
        slices.append(piece)
    slices[0].block_copies = out.block_copies
    slices[0].lora_loads = out.lora_loads  # loaded before the first micro-batch's forward
    return slices


def run_stage(runner: ModelRunner, comm: Communicator, plans: list[StepPlan]):
    """Runs this rank's stage over every micro-batch; returns the last stage's outputs per micro-batch."""
    layout = comm.layout
    hidden_size = runner.arch.hidden_size
    pending = []
    outputs = []
    for plan in plans:
        intermediate = feed = None
        if plan.feed_rows:  # an overlapped step (one stage): the tokens rank 0's draws are producing
            if plan.feed_sources is not None:  # its decode graph's greedy draws: this rank's graph has them too
                tokens = runner.graph_feed(plan)
            else:
                tokens = comm.broadcast_feed(None, len(plan.feed_rows))
            feed = (row_index(plan.feed_rows, runner.device), tokens)
        if comm.pp_rank > 0:
            shape = (plan.num_tokens, hidden_size)
            src = comm.neighbour(-1)
            intermediate = (comm.recv_tensor(shape, runner.dtype, src), comm.recv_tensor(shape, runner.dtype, src))
        result = runner.forward(plan, intermediate, feed)
        if comm.pp_rank < layout.pp - 1:
            dst = comm.neighbour(1)
            pending.extend(dist.isend(t.contiguous(), dst) for t in result)  # the next micro-batch starts now
        else:
            outputs.append(runner.compute_outputs(plan, result))
    for request in pending:
        request.wait()
    return outputs


@dataclass
class PipelinedStep:
    """A step of a pipeline in flight: queued on the first stage (rank 0), its logits still to come from the
    last. `outputs` (logits, prompt log-probabilities) once received; `sends` the transfers of its activations."""

    out: SchedulerOutput
    plan: StepPlan
    sends: list
    outputs: tuple | None = None


class DistributedRunner:
    """Rank 0's view of a multi-rank model: the engine calls it as it would a single runner. With one pipeline
    stage, steps overlap as on one rank (launch / collect): the plan goes to the other ranks over the plan channel
    while the device is busy, and the tokens of placeholder inputs come from each rank's own decode graph (greedy
    draws) or follow on the device (a broadcast from rank 0's draws), so no rank waits for its device between
    steps. Pipelines overlap steps (launch / collect of
    PipelinedStep): the scheduler keeps sequences whose draw is in flight out of the next step, so consecutive
    steps hold different sequences and the first stage computes step N+1 while the last finishes step N; without
    `pipeline_overlap` (disable_pipeline_overlap) they run each step to the end in micro-batches (execute)."""

    def __init__(self, runner: ModelRunner, comm: Communicator, pipeline_overlap: bool = True):
        self.runner = runner
        self.comm = comm
        self.device = runner.device
        self.pipelined = comm.layout.pp > 1
        self.can_overlap = not self.pipelined or pipeline_overlap
        self._unreceived: PipelinedStep | None = None

    @contextmanager
    def _ranks_in_step(self):
        """Around what rank 0 does once a step's plan is on its way to the other ranks: a failure there leaves
        them out of step with it (RanksOutOfStep)."""
        try:
            yield
        except Exception as exc:
            raise RanksOutOfStep(f"a step failed on rank 0 after the other ranks had started it: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep | PipelinedStep:
        if isinstance(previous, LaunchedStep):
            self.runner.draw_waiting(previous)  # before this step's forward overwrites the graphs' logits
        plan = plan_step(out, self.runner.block_size, self.runner.graph_prefill_rows)  # 0 for pipeline stages
        if self.pipelined:
            return self._launch_pipelined(out, plan)
        fed = self.runner.feed_tokens(out, plan, previous)
        with self._ranks_in_step():
            self.comm.broadcast_plans([plan])
            if plan.feed_rows and plan.feed_sources is None:
                fed = self.comm.broadcast_feed(fed, len(plan.feed_rows))
            return self.runner.launch_planned(out, plan, fed)

    def collect(self, launched: LaunchedStep | PipelinedStep) -> ModelOutput:
        if not isinstance(launched, PipelinedStep):
            return self.runner.collect(launched)
        with self._ranks_in_step():
            if launched.outputs is None:  # no later step was launched
                self._receive_pending()
            for send in launched.sends:
                send.wait()
        logits, prompt_logprobs = launched.outputs
        return ModelOutput(self.runner.sample(launched.out, logits), prompt_logprobs)

    def _launch_pipelined(self, out: SchedulerOutput, plan: StepPlan) -> PipelinedStep:
        """Queues the first stage's share of a step (one micro-batch: steps overlap instead). The step before's
        outputs are received before this step's activations are sent, the order in which the last stage sends
        and then receives, so that no transfer waits on one queued behind it (NCCL transfers larger than its
        buffers wait for their receiver)."""
        if plan.feed_rows:
            raise RuntimeError("a pipelined step's input is a placeholder: the scheduler must hold such sequences")
        with self._ranks_in_step():
            self.comm.broadcast_plans([plan])
            hidden, residual = self.runner.forward(plan)
            self._receive_pending()
            dst = self.comm.neighbour(1)
            sends = [self.comm.isend_tensor(t, dst) for t in (hidden, residual)]
        self._unreceived = step = PipelinedStep(out, plan, sends)
        return step

    def _receive_pending(self) -> None:
        step, self._unreceived = self._unreceived, None
        if step is not None:
            logits, entries = self._receive_outputs()
            step.outputs = (logits, entries)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        layout = self.comm.layout
        plans = [plan_step(piece, self.runner.block_size) for piece in split_schedule(out, layout.pp)]
        with self._ranks_in_step():
            self.comm.broadcast_plans(plans)
            outputs = run_stage(self.runner, self.comm, plans)
            if layout.pp > 1:
                outputs = [self._receive_outputs() for _ in plans]
        logits = [logit for logit, _ in outputs if logit is not None]
        prompt_logprobs = {}
        for _, entries in outputs:
            prompt_logprobs.update(entries)
        sample_logits = (logits[0] if len(logits) == 1 else torch.cat(logits)) if logits else None
        return ModelOutput(self.runner.sample(out, sample_logits), prompt_logprobs)

    def _receive_outputs(self):
        """One micro-batch's logits (over NCCL on GPUs: a device tensor, never pickled) and prompt
        log-probabilities from the last stage."""
        src = self.comm.last_stage_leader
        shape, entries = self.comm.recv_object(src)
        logits = self.comm.recv_tensor(shape, self.runner.dtype, src) if shape is not None else None
        return logits, entries

    def stop_workers(self) -> None:
        self._receive_pending()  # a pipelined step's outputs, which the last stage sends before it can stop
        self.comm.broadcast_plans(None)


def worker_loop(runner: ModelRunner, comm: Communicator) -> None:
    """Ranks other than 0: run every step rank 0 broadcasts, until it broadcasts None. The last stage's leader
    sends each step's outputs to rank 0 without waiting for their receipt (rank 0 may first broadcast the next
    plan), and waits for them only after its next step."""
    sending: list[Sending] = []
    while True:
        plans = comm.broadcast_plans(None)
        if plans is None:
            for transfer in sending:
                transfer.wait()
            return
        outputs = run_stage(runner, comm, plans)
        for transfer in sending:
            transfer.wait()
        sending = []
        if outputs and comm.rank == comm.last_stage_leader:
            for logits, entries in outputs:
                sending.append(comm.isend_object((tuple(logits.shape) if logits is not None else None, entries), 0))
                if logits is not None:
                    sending.append(comm.isend_tensor(logits.to(runner.dtype), 0))
