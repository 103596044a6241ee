"""The worker actor: one per device, pinned to its placement-group bundle.

Rank 0 hosts the engine loop (on a thread of the actor) and the engine channel's far end: submissions
and aborts arrive through an ordered concurrency group, outputs leave through one streaming generator for the
engine's life, each item every iteration output gathered since the last (one Ray object a batch, no call per
batch). The other ranks run the worker loop. Each worker does its torch work on one thread (TorchThread): it
loads the model and builds the cache there, then runs its loop there.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import queue
import signal
import traceback
from typing import Any

import torch

from raylm.actors.distributed_runner import DistributedRunner
from raylm.actors.distributed_runner import worker_loop as run_worker_loop
from raylm.actors.engine_loop import EngineLoop, TorchThread
from raylm.actors.executor import control_engine
from raylm.actors.symmetric_memory import all_reduce_norm_requested
from raylm.actors.transport import Communicator, RankLayout, free_address, init_distributed
from raylm.actors.worker import Worker
from raylm.engine.messages import EngineRequest, StepOutput
from raylm.engine_spec import EngineInfo, WorkerSpec
from raylm.models.loader import load_hf_config
from raylm.models.registry import resolve_architecture

# `kill -USR1 PID` makes a worker print every thread's Python stack to its log (Ray's worker-*.err): where each
# rank waits when a step hangs. benchmarks/h200.sh does this before it stops a command that ran out of time.
STACKS_SIGNAL = signal.SIGUSR1
# Concurrency groups of the actor: ordered control messages, the output stream, the blocking loops.
CONCURRENCY_GROUPS = {"control": 1, "outputs": 1, "loop": 1}
# Set in a worker's runtime_env when its ranks must see every GPU of the node (each at a distinct index, as the
# symmetric-memory all-reduce requires); Ray then leaves CUDA_VISIBLE_DEVICES as the node has it.
ALL_GPUS_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
_OUTPUT_WAIT_S = 0.5  # how long the output stream waits for an output before it looks whether the engine stopped


def cuda_index(gpu_id: str, visible: str | None) -> int:
    """The CUDA device index of the node GPU that Ray calls gpu_id, in a process whose CUDA_VISIBLE_DEVICES is
    `visible` (None: every GPU, in the node's order)."""
    if not visible:
        return int(gpu_id)
    order = [entry.strip() for entry in visible.split(",")]
    if gpu_id not in order:
        raise RuntimeError(f"GPU {gpu_id} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return order.index(gpu_id)


def own_gpu_index() -> int | None:
    """Where every GPU of the node is visible, the CUDA index of the one Ray assigned to this actor; None where
    Ray shows the actor its own GPU alone (as device 0, the current device of every thread)."""
    if os.environ.get(ALL_GPUS_VISIBLE) != "1":
        return None
    import ray

    gpu_ids = ray.get_gpu_ids()
    return cuda_index(str(gpu_ids[0]), os.environ.get("CUDA_VISIBLE_DEVICES")) if gpu_ids else None


def resolve_extension(extension: type | str | None) -> type | None:
    """A worker extension class, given as a class or as 'module.Class'."""
    if extension is None or isinstance(extension, type):
        return extension
    module, _, name = extension.rpartition(".")
    if not module:
        raise ValueError(f"worker_extension_cls must be 'module.Class', got {extension!r}")
    return getattr(importlib.import_module(module), name)


class RayWorker:
    def __init__(self, spec: WorkerSpec, rank: int, layout: RankLayout, extension: type | str | None = None):
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
        self.gpu_index = own_gpu_index() if spec.device == "cuda" else None
        self.bind_gpu()
        self.spec = spec
        self.rank = rank
        self.layout = layout
        extension_cls = resolve_extension(extension)
        self.worker_cls = type("ExtendedWorker", (Worker, extension_cls), {}) if extension_cls else Worker
        self.comm: Communicator | None = None
        self.worker: Worker | None = None
        self.loop: EngineLoop | None = None
        self.outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        self._stopped = False  # rank 0's engine loop was stopped: the output stream ends once drained
        self.loop_error: str | None = None
        # The thread of every torch call until the loop, which then runs on it (TorchThread).
        self.torch = TorchThread()
        self.torch.run(self.bind_gpu)

    def bind_gpu(self) -> None:
        """Makes this actor's GPU the calling thread's current device. CUDA's current device is per thread, and
        the actor's methods run on its concurrency groups' threads (and the engine loop on its own), so every
        method that reaches the GPU binds first; a no-op where Ray shows the actor its own GPU alone."""
        if self.gpu_index is not None:
            torch.cuda.set_device(self.gpu_index)

    # ------------------------------------------------------------------ start-up

    def node_address(self) -> tuple[str, int]:
        return free_address()

    def init_distributed(self, address: str, port: int) -> None:
        self.torch.run(self._init_distributed, address, port)

    def _init_distributed(self, address: str, port: int) -> None:
        device = torch.device(self.spec.device, self.gpu_index) if self.gpu_index is not None else \
            torch.device(self.spec.device)
        if self.layout.world_size > 1:
            self.comm = init_distributed(self.rank, self.layout, address, port, device,
                                         dtype=getattr(torch, self.spec.dtype), hidden_size=self._hidden_size(),
                                         kernel_config=self.spec.args.kernel_config)
            self.worker = self.worker_cls(self.spec, self.comm.ctx)
        else:
            self.worker = self.worker_cls(self.spec)

    def _hidden_size(self) -> int | None:
        """The model's hidden size where a fused all-reduce + RMSNorm is asked for (its buffers' width)."""
        if not all_reduce_norm_requested(self.spec.args.kernel_config, self.spec.device):
            return None
        hf_config = load_hf_config(self.spec.source, self.spec.args.trust_remote_code)
        return resolve_architecture(hf_config)[1].hidden_size

    def load_model(self) -> int:
        return self.torch.run(self.worker.load_model)

    def init_cache(self, num_blocks: int) -> EngineInfo:
        return self.torch.run(self.worker.init_cache, num_blocks)

    def start_engine(self, num_blocks: int) -> dict:
        """Rank 0: builds the engine core over all ranks and starts its loop; returns the start-up timings."""
        overlap = not self.spec.args.disable_pipeline_overlap
        runner = DistributedRunner(self.worker.runner, self.comm, overlap) if self.comm is not None else None
        engine = self.torch.run(self.worker.build_engine, num_blocks, runner)
        self.loop = EngineLoop(engine, self.outputs.put, thread=self.torch)  # bound to the GPU at __init__
        self.loop.start()
        return self.worker.timings

    # ------------------------------------------------------------------ loops (concurrency group "loop")

    def run_worker_loop(self) -> None:
        """Ranks > 0: runs (on the torch thread) until rank 0 stops the workers; raises if the loop fails."""
        self.torch.hand_over(lambda: run_worker_loop(self.worker.runner, self.comm)).result()

    def watch_engine(self) -> None:
        """Rank 0: returns when the engine loop ends; raises if it died."""
        self.loop.thread.join()
        if self.loop.error is not None:
            raise RuntimeError(f"engine loop died: {self.loop.error!r}")

    # ------------------------------------------------------------------ engine channel (rank 0)

    def submit(self, requests: list[EngineRequest]) -> None:
        self.loop.submit(requests)

    def abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.loop.stop_sequences(sequences)

    def stream_outputs(self):
        """Rank 0: the engine's outputs for its whole life, as a Ray streaming generator (the executor iterates it
        with num_returns="streaming"): each item is every iteration output since the previous one. Ends once the
        engine has stopped and its last outputs are out."""
        while True:
            batch = self.get_outputs(_OUTPUT_WAIT_S)
            if batch:
                yield batch
            elif self._stopped:
                return

    def get_outputs(self, timeout: float) -> list[StepOutput]:
        """Every iteration output since the last call; waits up to timeout for the first."""
        try:
            batch = [self.outputs.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self.outputs.get_nowait())
            except queue.Empty:
                return batch

    # ------------------------------------------------------------------ RPC and shutdown

    def engine_call(self, method: str, args: tuple) -> Any:
        """Rank 0: an engine control (actors/executor.py) on the engine thread, between iterations."""
        self.bind_gpu()
        return control_engine(self.loop, method, args)

    def execute_method(self, method: str, args: tuple, kwargs: dict) -> Any:
        """A worker method (collective_rpc): on the torch thread before the loop; on rank 0's engine thread
        between iterations while its loop runs (as the in-process executor runs it); else on the calling thread
        (ranks > 0 in their worker loop, which waits on rank 0, and any rank once its loop has ended)."""
        fn = getattr(self.worker, method, None)
        if fn is None or method.startswith("_") or not callable(fn):
            raise ValueError(f"worker has no method {method!r}")
        if not self.torch.handed_over:
            return self.torch.run(fn, *args, **kwargs)
        if self.loop is not None and self.loop.thread.is_alive():
            return self.loop.call(lambda _engine: fn(*args, **kwargs)).result()
        self.bind_gpu()
        return fn(*args, **kwargs)

    def stop(self) -> None:
        """Rank 0: stops the engine loop and releases the other ranks from their loop."""
        if self.loop is None:
            return
        self.bind_gpu()
        self.loop.stop()
        self._stopped = True
        if self.comm is not None:
            try:
                DistributedRunner(self.worker.runner, self.comm).stop_workers()
            except Exception:
                traceback.print_exc()
