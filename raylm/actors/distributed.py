"""Process groups and the multi-rank step.

Ranks are laid out stage-major: rank = pp_rank * tp + tp_rank. `torch.distributed` is initialised through
a TCPStore at rank 0: NCCL carries CUDA tensors (tensor-parallel all-reduces, pipeline activations on
GPUs), gloo carries CPU tensors and control; the step plan that rank 0 sends every iteration goes over TCP sockets of
its own when there is one pipeline stage (PlanChannel), else over gloo.

Rank 0 hosts the engine. Each step it broadcasts the plan (split into pp micro-batches), runs its own
stage, and under pipeline parallelism receives the logits from the last stage; the other ranks run
`worker_loop`: receive the plan, run their stage, pass activations on. Stages work on different
micro-batches at the same time.
"""

from __future__ import annotations

import bisect
import datetime
import itertools
import logging
import pickle
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from raylm.actors.symmetric_memory import all_reduce_norm_requested, fast_all_reduce, fused_norm
from raylm.engine.model_runner import LaunchedStep, ModelOutput, ModelRunner, RanksOutOfStep, StepPlan, plan_step
from raylm.engine.sampler import row_index
from raylm.engine.scheduler import SchedulerOutput
from raylm.kernels.dispatch import env_switch
from raylm.models.parallel import ParallelContext

logger = logging.getLogger(__name__)

# Idle workers wait in a broadcast for the next step; a dead peer is detected by the driver, not by this.
_CONTROL_TIMEOUT = datetime.timedelta(days=30)
# A step plan's first broadcast message: its size, then the pickled plan. Decode plans of small batches fit it
# whole, so each step costs one gloo broadcast (broadcast_object_list takes two: the size, then the data); a
# larger plan's remainder follows in a second.
_PLAN_MESSAGE_BYTES = 16 << 10
_SIZE_BYTES = 8
# Socket buffers of the plan channel: a step's plan (a few hundred bytes at small batches, ~100 KB at large ones)
# is handed to the kernel without waiting for the reader.
_PLAN_SOCKET_BUFFER = 4 << 20


class PlanChannel:
    """Rank 0's step plans to the other ranks over TCP connections of their own (Nagle off): a plan costs a
    pickle and one send per rank, without gloo's collective machinery (~20 against ~140 us for rank 0 on a small
    CPU), and a reader waits in a blocking receive. Only with one pipeline stage, whose other ranks never wait on
    rank 0's host for anything but the plan: a send that filled a reader's buffer is always read in time."""

    def __init__(self, sockets: list[socket.socket]):
        self.sockets = sockets

    @classmethod
    def open(cls, rank: int, world: int, address: str, control, timeout_s: float) -> PlanChannel:
        """Rank 0 listens on `address` and tells the others its port over `control` (collective: every rank)."""
        if rank == 0:
            with socket.create_server((address, 0)) as server:
                port = [server.getsockname()[1]]
                dist.broadcast_object_list(port, src=0, group=control)
                server.settimeout(timeout_s)
                sockets = [server.accept()[0] for _ in range(world - 1)]
        else:
            port = [None]
            dist.broadcast_object_list(port, src=0, group=control)
            sockets = [socket.create_connection((address, port[0]), timeout=timeout_s)]
        for sock in sockets:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PLAN_SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _PLAN_SOCKET_BUFFER)
        return cls(sockets)

    def send(self, plans: list[StepPlan] | None) -> None:
        data = pickle.dumps(plans, protocol=pickle.HIGHEST_PROTOCOL)
        message = len(data).to_bytes(_SIZE_BYTES, "little") + data
        for sock in self.sockets:
            sock.sendall(message)

    def receive(self) -> list[StepPlan] | None:
        size = int.from_bytes(self._read(_SIZE_BYTES), "little")
        return pickle.loads(self._read(size))

    def _read(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view, filled = memoryview(buffer), 0
        while filled < size:
            count = self.sockets[0].recv_into(view[filled:])
            if count == 0:
                raise ConnectionError("rank 0 closed the plan channel")
            filled += count
        return buffer


@dataclass(frozen=True)
class RankLayout:
    tp: int
    pp: int
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port for the TCPStore."""
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:
        host = "127.0.0.1"
    with socket.socket() as sock:
        sock.bind(("", 0))
        return host, sock.getsockname()[1]


@dataclass
class Communicator:
    """This rank's process groups."""

    rank: int
    layout: RankLayout
    device: torch.device
    control: object  # gloo group over all ranks
    ctx: ParallelContext
    plan_channel: PlanChannel | None = None
    _plan_message: torch.Tensor = field(default_factory=lambda: torch.empty(_PLAN_MESSAGE_BYTES, dtype=torch.uint8))

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    def neighbour(self, stage_offset: int) -> int:
        return self.layout.rank_of(self.pp_rank + stage_offset, self.tp_rank)

    @property
    def last_stage_leader(self) -> int:
        return self.layout.rank_of(self.layout.pp - 1, 0)

    def broadcast_plans(self, plans: list[StepPlan] | None) -> list[StepPlan] | None:
        """Rank 0's plans (None: stop) to every rank: over the plan channel where there is one, else over gloo
        (one broadcast message for most steps)."""
        if self.plan_channel is not None:
            if self.rank == 0:
                self.plan_channel.send(plans)
                return plans
            return self.plan_channel.receive()
        message = self._plan_message.numpy()
        capacity = message.size - _SIZE_BYTES
        if self.rank == 0:
            data = pickle.dumps(plans, protocol=pickle.HIGHEST_PROTOCOL)
            head = min(len(data), capacity)
            message[:_SIZE_BYTES] = np.frombuffer(len(data).to_bytes(_SIZE_BYTES, "little"), dtype=np.uint8)
            message[_SIZE_BYTES : _SIZE_BYTES + head] = np.frombuffer(data, dtype=np.uint8, count=head)
            dist.broadcast(self._plan_message, src=0, group=self.control)
            if len(data) > capacity:
                dist.broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8), src=0, group=self.control)
            return plans
        dist.broadcast(self._plan_message, src=0, group=self.control)
        size = int.from_bytes(message[:_SIZE_BYTES].tobytes(), "little")
        data = message[_SIZE_BYTES : _SIZE_BYTES + min(size, capacity)].tobytes()
        if size > capacity:
            rest = torch.empty(size - capacity, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.control)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def broadcast_feed(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """The feed rows' tokens from the stage leader to its tensor-parallel peers, queued on the device (the
        leader's come from its draws still in flight; nothing waits for them on the host)."""
        if tokens is None:
            tokens = torch.empty(count, dtype=torch.long, device=self.device)
        else:
            tokens = tokens.to(torch.long)
        if self.layout.tp > 1:
            dist.broadcast(tokens, src=self.layout.rank_of(self.pp_rank, 0), group=self.ctx.tp_group)
        return tokens

    def isend_tensor(self, tensor: torch.Tensor, dst: int) -> Sending:
        tensor = tensor.contiguous()
        return Sending([dist.isend(tensor, dst)], [tensor])

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, src)
        return tensor

    def isend_object(self, obj: object, dst: int) -> Sending:
        """Sends a picklable object over gloo without waiting for the receiver: gloo's sends wait for their
        receive, and rank 0 may receive only after its next plan broadcast (overlapped pipeline steps)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        return Sending([dist.isend(size, dst, group=self.control), dist.isend(data, dst, group=self.control)],
                       [size, data])

    def recv_object(self, src: int) -> object:
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, src, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.control)
        return pickle.loads(data.numpy().tobytes())


@dataclass
class Sending:
    """Transfers in progress and the tensors they read (kept alive until they are done)."""

    works: list
    tensors: list

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _agreed(candidate, group):
    """candidate where every rank of `group` has one, else None on every rank (they must take the same path)."""
    agreed = torch.tensor([int(candidate is not None)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return candidate if agreed.item() else None


def init_distributed(rank: int, layout: RankLayout, address: str, port: int, device: torch.device,
                     timeout_s: float = 600.0, dtype: torch.dtype | None = None,
                     hidden_size: int | None = None) -> Communicator:
    """Joins the job's process groups (every rank calls this with the same layout, address and port). With
    `dtype` (the model's), a symmetric-memory all-reduce may serve small tensors on GPUs (SymmetricAllReduce); there
    (and on CPUs with RAYLM_ALLREDUCE_NORM=1) the o / down projections leave their all-reduce to the RMSNorm after
    them, which with symmetric memory does it in one kernel for models of `hidden_size` (SymmetricAllReduceNorm;
    actors/symmetric_memory.py says how to turn either off)."""
    world = layout.world_size
    store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    control = dist.new_group(list(range(world)), backend="gloo", timeout=_CONTROL_TIMEOUT)
    tp_group = None
    for stage in range(layout.pp):  # every rank creates every group, in the same order
        ranks = [layout.rank_of(stage, t) for t in range(layout.tp)]
        group = dist.new_group(ranks, backend=backend)
        if stage == layout.pp_rank(rank):
            tp_group = group
    fast = fused = None
    defer_reduce = layout.tp > 1 and all_reduce_norm_requested(device.type)
    if layout.tp > 1:
        fast = _agreed(fast_all_reduce(tp_group, device, dtype), control)
    if defer_reduce:
        fused = _agreed(fused_norm(tp_group, device, dtype, hidden_size), control)
    ctx = ParallelContext(tp_rank=layout.tp_rank(rank), tp_size=layout.tp, tp_group=tp_group,
                          pp_rank=layout.pp_rank(rank), pp_size=layout.pp, ep_size=layout.ep, fast_all_reduce=fast,
                          defer_reduce=defer_reduce, fused_norm=fused)
    channel = PlanChannel.open(rank, world, address, control, timeout_s) if layout.pp == 1 else None
    if layout.pp > 1:
        _connect_pipeline(rank, layout, device)
    return Communicator(rank, layout, device, control, ctx, channel)


def _connect_pipeline(rank: int, layout: RankLayout, device: torch.device) -> None:
    """Makes every point-to-point link a pipeline uses (activations to the next stage, outputs from the last
    stage's leader to rank 0) before the first step. NCCL connects a pair on its first transfer, and the sender
    waits there on its host until the receiver joins: with overlapped steps the last stage sends step N's outputs
    while rank 0 waits for it in step N+1's plan broadcast, so a first connection made then never completes. The
    links are made one at a time in the same order on every rank, which cannot deadlock."""
    links = [(layout.rank_of(stage, t), layout.rank_of(stage + 1, t))
             for stage in range(layout.pp - 1) for t in range(layout.tp)]
    links.append((layout.rank_of(layout.pp - 1, 0), 0))
    probe = torch.zeros(1, device=device)
    for src, dst in links:
        if rank == src:
            dist.send(probe, dst)
        elif rank == dst:
            dist.recv(probe, src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def pipeline_overlap_requested() -> bool:
    """Whether pipelines overlap consecutive steps (the default; RAYLM_PP_OVERLAP=0 runs each step to the end in
    micro-batches)."""
    return env_switch("RAYLM_PP_OVERLAP", True)


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
    stage, steps overlap as on one rank (launch / collect): the plan goes to the other ranks over gloo while
    the device is busy, and the tokens of placeholder inputs follow on the device (a broadcast from rank 0's
    draws), so no rank waits for its device between steps. Pipelines overlap steps (launch / collect of
    PipelinedStep): the scheduler keeps sequences whose draw is in flight out of the next step, so consecutive
    steps hold different sequences and the first stage computes step N+1 while the last finishes step N; with
    RAYLM_PP_OVERLAP=0 they run each step to the end in micro-batches (execute)."""

    def __init__(self, runner: ModelRunner, comm: Communicator):
        self.runner = runner
        self.comm = comm
        self.device = runner.device
        self.pipelined = comm.layout.pp > 1
        self.can_overlap = not self.pipelined or pipeline_overlap_requested()
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
        plan = plan_step(out, self.runner.block_size)
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
