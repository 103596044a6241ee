"""The engine loop: runs iterations while there is work, between iterations takes in new requests,
aborts and control calls, and hands each iteration's output to the outbox. It never waits on the driver."""

from __future__ import annotations

import functools
import gc
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from raylm.engine.engine_core import EngineCore
from raylm.engine.messages import EngineRequest, RequestDelta, StepOutput

logger = logging.getLogger(__name__)

_STOP = object()

# The engine allocates a few small objects per sequence per step. With Python's default collector thresholds
# (700, 10, 10) a full collection ran every few steps at large batches, traversing every live object of the
# process (the model's modules, every request): half of the host time of a step at batch 512.
GC_GEN0_THRESHOLD = 50_000


def tune_garbage_collector() -> None:
    """Collects generation 0 less often: raises the process's threshold, never lowers it. (Not gc.freeze: in a
    trainer's process that would keep any cycle made before it alive for good.)"""
    threshold, *older = gc.get_threshold()
    if threshold < GC_GEN0_THRESHOLD:
        gc.set_threshold(GC_GEN0_THRESHOLD, *older)


class TorchThread:
    """A worker's one thread for its torch work: run(fn, ...) runs fn there and returns what it returned (raising
    what it raised) until hand_over(fn) gives the thread to fn for good (an engine or worker loop), after which the
    thread ends with fn. On a CPU the thread that runs torch's parallel work owns an OpenMP pool, and a second
    thread's pool makes OpenMP's threads sleep between a decode step's small parallel regions rather than spin
    (EngineLoop): a Ray worker that loads on one thread and steps on another pays a wake-up each region."""

    def __init__(self, name: str = "raylm-torch"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.handed_over = False
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller of run, or of hand_over's future, gets it
                future.set_exception(exc)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.handed_over:
            raise RuntimeError("the torch thread runs a loop now")
        future: Future = Future()
        self._jobs.put((functools.partial(fn, *args, **kwargs), future))
        return future.result()

    def hand_over(self, fn: Callable[[], Any]) -> Future:
        """Runs fn as the thread's last job; its Future resolves when fn returns (or raises)."""
        self.handed_over = True
        future: Future = Future()
        self._jobs.put((fn, future))
        self._jobs.put(None)
        return future


class EngineLoop:
    def __init__(self, engine: EngineCore | None, outbox: Callable[[StepOutput], None],
                 on_thread_start: Callable[[], None] | None = None,
                 build: Callable[[], EngineCore] | None = None, thread: TorchThread | None = None):
        """on_thread_start runs first on the loop's thread (a Ray worker binds its GPU there). build: where engine
        is None, makes the engine on the loop's thread before the loop runs; start returns once it has, raising
        what it raised. (On a CPU the thread that runs torch's first parallel work owns an OpenMP pool; a second
        thread's pool, as from loading the model on the caller's thread, makes OpenMP's threads sleep between
        the small parallel regions of a decode step rather than spin, each then paying a wake-up.) thread: the
        TorchThread the loop runs on, handed over at start (the one that loaded the model); else a thread of its
        own."""
        if (engine is None) == (build is None):
            raise ValueError("EngineLoop takes an engine or a build function, one of them")
        self.engine = engine
        self.outbox = outbox
        self.on_thread_start = on_thread_start
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._torch_thread = thread
        self.thread = thread.thread if thread is not None else threading.Thread(target=self._run, name="raylm-engine",
                                                                                daemon=True)
        self.error: BaseException | None = None
        self._build = build
        self._built: Future = Future()

    def start(self) -> None:
        tune_garbage_collector()
        if self._torch_thread is not None:
            self._torch_thread.hand_over(self._run)
        else:
            self.thread.start()
        if self._build is not None:
            self._built.result()

    def stop(self, timeout: float = 30.0) -> None:
        self.inbox.put(_STOP)
        if self.thread.is_alive():
            self.thread.join(timeout)

    # Commands, callable from any thread.

    def submit(self, requests: list[EngineRequest]) -> None:
        self.inbox.put(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        self.inbox.put(("abort", request_ids))

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.inbox.put(("stop_sequences", sequences))

    def call(self, fn: Callable[[EngineCore], Any]) -> Future:
        """Runs fn(engine) on the engine thread between iterations."""
        future: Future = Future()
        self.inbox.put(("call", fn, future))
        return future

    # The loop.

    def _handle(self, command: Any, deltas: list[RequestDelta]) -> bool:
        if command is _STOP:
            return False
        kind = command[0]
        if kind == "add":
            for request in command[1]:
                try:
                    self.engine.add_request(request)
                except Exception as exc:  # an unacceptable request fails alone
                    deltas.append(RequestDelta(request.request_id, finished=True, error=str(exc)))
        elif kind == "abort":
            for request_id in command[1]:
                delta = self.engine.abort_request(request_id)
                if delta is not None:
                    deltas.append(delta)
        elif kind == "stop_sequences":
            for request_id, index in command[1]:
                delta = self.engine.stop_sequence(request_id, index)
                if delta is not None:
                    deltas.append(delta)
        elif kind == "call":
            _, fn, future = command
            drained = self.engine.drain()  # no step in flight while fn acts on the engine
            if drained is not None and (drained.deltas or drained.stats or drained.kv_events):
                self.outbox(drained)
            try:
                result, error = fn(self.engine), None
            except Exception as exc:
                result, error = None, exc
            controlled = self.engine.take_control_deltas()  # reach the driver before the caller hears back
            if controlled:
                self.outbox(StepOutput(deltas + controlled, weight_version=self.engine.weight_version))
                deltas.clear()
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        return True

    def _run(self) -> None:
        if self._build is not None:
            try:
                if self.on_thread_start is not None:
                    self.on_thread_start()
                self.engine = self._build()
            except BaseException as exc:  # start raises it on the caller's thread
                self._built.set_exception(exc)
                return
            self._built.set_result(None)
        running = True
        try:
            if self._build is None and self.on_thread_start is not None:
                self.on_thread_start()
            while running:
                deltas: list[RequestDelta] = []
                command = self.inbox.get() if not self.engine.has_work else None
                while command is not None or not self.inbox.empty():
                    if command is None:
                        command = self.inbox.get_nowait()
                    running = self._handle(command, deltas) and running
                    command = None
                if deltas:
                    self.outbox(StepOutput(deltas, weight_version=self.engine.weight_version))
                if running and self.engine.has_work:
                    output = self.engine.step()
                    if output.deltas or output.stats or output.kv_events:
                        self.outbox(output)
        except BaseException as exc:  # the engine is dead; the driver fails what is pending
            logger.exception("engine loop died")
            self.error = exc
            self.outbox(StepOutput(fatal_error=f"engine loop died: {type(exc).__name__}: {exc}"))
