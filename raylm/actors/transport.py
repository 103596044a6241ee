"""The wires of a multi-rank engine: process groups, the step-plan channel and point-to-point transfers.

Ranks are laid out stage-major: rank = pp_rank * tp + tp_rank. `torch.distributed` is initialised through a
TCPStore at rank 0: NCCL carries CUDA tensors (tensor-parallel all-reduces, pipeline activations on GPUs), gloo
carries CPU tensors and control. The step plan that rank 0 sends every iteration goes over TCP connections of its
own when there is one pipeline stage (PlanChannel), else over gloo. Pipelines make their point-to-point links at
start-up. What runs over these wires is actors/distributed_runner.py's.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import socket
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from raylm.actors.symmetric_memory import (
    all_reduce_norm_requested,
    fast_all_reduce,
    fused_norm,
    symmetric_all_reduce_requested,
)
from raylm.config import KernelConfig
from raylm.engine.step_plan import StepPlan
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
                     timeout_s: float = 600.0, dtype: torch.dtype | None = None, hidden_size: int | None = None,
                     kernel_config: KernelConfig | None = None) -> Communicator:
    """Joins the job's process groups (every rank calls this with the same layout, address, port and config).
    With `dtype` (the model's), a symmetric-memory all-reduce may serve small tensors on GPUs (SymmetricAllReduce);
    there (and on CPUs with kernel_config.fused_allreduce_norm) the o / down projections leave their all-reduce to
    the RMSNorm after them, which with symmetric memory does it in one kernel for models of `hidden_size`
    (SymmetricAllReduceNorm; actors/symmetric_memory.py)."""
    kernel_config = kernel_config or KernelConfig()
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
    defer_reduce = layout.tp > 1 and all_reduce_norm_requested(kernel_config, device.type)
    if layout.tp > 1 and symmetric_all_reduce_requested(kernel_config, device.type):
        fast = _agreed(fast_all_reduce(tp_group, device, dtype), control)
    if defer_reduce and kernel_config.triton:
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
