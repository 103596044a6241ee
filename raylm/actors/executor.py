"""Executors: how the driver reaches the engine. The engine channel is the same whatever runs behind it:
submit and abort never block the engine; outputs come back one batch per engine iteration."""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from typing import Any

from raylm.actors.engine_loop import EngineLoop
from raylm.actors.worker import Worker
from raylm.engine.engine_core import EngineCore
from raylm.engine.messages import EngineRequest, StepOutput
from raylm.engine_spec import EngineInfo, WorkerSpec

# EngineCore methods the driver may run on the engine thread between iterations (Executor.engine_call).
ENGINE_CONTROLS = frozenset({"pause", "resume_generation", "new_weight_version", "forget_kv", "remove_lora"})


def control_engine(loop: EngineLoop, method: str, args: tuple) -> Any:
    """Runs EngineCore.`method`(*args) on the loop's thread between iterations (the step in flight applied
    first) and returns its result."""
    if method not in ENGINE_CONTROLS:
        raise ValueError(f"engine control must be one of {sorted(ENGINE_CONTROLS)}, got {method!r}")
    return loop.call(lambda engine: getattr(engine, method)(*args)).result()


class Executor(ABC):
    info: EngineInfo

    @abstractmethod
    def submit(self, requests: list[EngineRequest]) -> None: ...

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        """Ends single sequences (request id, sequence index) whose text hit a stop string."""

    @abstractmethod
    def get_output(self, timeout: float) -> StepOutput | None:
        """The next iteration's output, or None after timeout seconds without one."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       target_ranks: list[int] | None = None) -> list[Any]: ...

    @abstractmethod
    def engine_call(self, method: str, args: tuple = ()) -> Any:
        """Runs an engine control (ENGINE_CONTROLS) on rank 0's engine thread between iterations."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def is_healthy(self) -> bool:
        return True


class LocalExecutor(Executor):
    """One worker in this process, built on the background thread its engine loop then runs on: on a CPU that
    thread alone runs torch's parallel work (EngineLoop: SmolLM2's decode steps at batch 1 and 8 were 17-24% faster
    than with the model loaded on the caller's thread, docs/benchmarks.md)."""

    def __init__(self, spec: WorkerSpec):
        self.outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()

        def build() -> EngineCore:
            self.worker = Worker(spec)
            self.info = self.worker.start()
            return self.worker.engine

        self.loop = EngineLoop(None, self.outputs.put, build=build)
        self.loop.start()

    def submit(self, requests: list[EngineRequest]) -> None:
        self.loop.submit(requests)

    def abort(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.loop.stop_sequences(sequences)

    def get_output(self, timeout: float) -> StepOutput | None:
        try:
            return self.outputs.get(timeout=timeout)
        except queue.Empty:
            return None

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       target_ranks: list[int] | None = None) -> list[Any]:
        if target_ranks is not None and any(rank != 0 for rank in target_ranks):
            raise ValueError(f"target_ranks must be within [0, 0] for a single worker, got {target_ranks}")
        fn = getattr(self.worker, method, None)
        if fn is None or method.startswith("_") or not callable(fn):
            raise ValueError(f"worker has no method {method!r}")
        # On the engine thread, between iterations, so the call never races a step.
        return [self.loop.call(lambda _engine: fn(*args, **(kwargs or {}))).result()]

    def engine_call(self, method: str, args: tuple = ()) -> Any:
        return control_engine(self.loop, method, args)

    def is_healthy(self) -> bool:
        return self.loop.thread.is_alive()

    def shutdown(self) -> None:
        self.loop.stop()
        if not self.loop.thread.is_alive():  # a stuck step keeps its memory rather than lose it mid-kernel
            self.loop.engine = None
            self.worker.close()
