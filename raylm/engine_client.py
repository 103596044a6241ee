"""The driver's side of the engine channel: submits requests, and on an output thread folds each
iteration's deltas into request states and hands outputs to the waiting GenerationResults."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from raylm.actors.executor import Executor
from raylm.engine.messages import EncodeRequest, EngineRequest, StepOutput
from raylm.lora_request import LoRARequest
from raylm.output_processor import EncodeState, RequestState
from raylm.results import GenerationResult
from raylm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine stopped; no request can be served."""


class EngineClient:
    def __init__(self, executor: Executor, tokenizer: Any, max_stats: int, max_kv_events: int):
        self.executor = executor
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._requests: dict[str, tuple[RequestState | EncodeState, GenerationResult]] = {}
        self._stats: deque[dict] = deque(maxlen=max(1, max_stats))
        self._kv_events: deque[dict] = deque(maxlen=max(1, max_kv_events))
        self._news = threading.Condition()
        self._closed = False
        self.dead_reason: str | None = None
        self._thread = threading.Thread(target=self._pump, name="raylm-outputs", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ requests

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def unfinished_ids(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def wait_finished(self, request_ids: list[str], timeout: float) -> None:
        """Returns once none of request_ids is pending (their last outputs delivered), or raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._news:
            while any(request_id in self._requests for request_id in request_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"requests did not finish within {timeout} s")
                self._news.wait(min(left, 0.05))

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            priority: float, cache_salt: str | None, streaming: bool,
            lora_request: LoRARequest | None = None) -> GenerationResult:
        state = RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer, streaming)
        request = EngineRequest(request_id, prompt_token_ids, params, priority, cache_salt, lora_request)
        return self._add(state, request, streaming)

    def add_encode(self, requests: list[tuple[str, str | None, list[int]]]) -> list[GenerationResult]:
        """Submits prompts to encode, (request id, text, token ids) each, in one message to the engine; each
        result's output is an EncoderOutput."""
        results = [self._add(EncodeState(request_id, prompt, token_ids), None, False)
                   for request_id, prompt, token_ids in requests]
        self.executor.submit([EncodeRequest(request_id, token_ids) for request_id, _, token_ids in requests])
        return results

    def _add(self, state: RequestState | EncodeState, request: EngineRequest | None,
             streaming: bool) -> GenerationResult:
        if self.dead_reason is not None or self._closed:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'shut down'}")
        result = GenerationResult(state.request_id, streaming, self.abort)
        with self._lock:
            self._requests[state.request_id] = (state, result)
        if request is not None:
            self.executor.submit([request])
        return result

    def abort(self, request_id: str) -> None:
        if request_id in self._requests:
            self.executor.abort([request_id])

    # ------------------------------------------------------------------ output thread

    def _pump(self) -> None:
        while not self._closed:
            try:
                output = self.executor.get_output(timeout=0.1)
            except Exception as exc:  # the channel itself broke: the engine is unreachable
                self._fail_all(f"engine channel failed: {type(exc).__name__}: {exc}")
                return
            if output is not None:
                try:
                    self._process(output)
                except Exception:
                    logger.exception("processing engine outputs failed")

    def _process(self, output: StepOutput) -> None:
        if output.fatal_error:
            self._fail_all(output.fatal_error)
            return
        if output.stats is not None or output.kv_events:
            with self._news:
                if output.stats is not None:
                    self._stats.append(output.stats)
                self._kv_events.extend(output.kv_events)
                self._news.notify_all()
        stopped: list[tuple[str, int]] = []
        for delta in output.deltas:
            entry = self._requests.get(delta.request_id)
            if entry is None:
                continue
            state, result = entry
            stopped.extend(state.apply(delta, output.weight_version))
            if state.error is not None:
                self._forget(delta.request_id)
                result.fail(state.error)
            elif state.finished:
                self._forget(delta.request_id)
                result.push(state.snapshot())
            elif state.stream_each_step:
                result.push(state.snapshot())
        if stopped:
            self.executor.stop_sequences(stopped)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def mark_dead(self, reason: str) -> None:
        """The engine cannot serve (found by a health check): pending requests fail, new ones are refused."""
        if self.dead_reason is None:
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        with self._lock:
            pending, self._requests = list(self._requests.values()), {}
        for _, result in pending:
            result.fail(reason)

    # ------------------------------------------------------------------ stats and events

    def _take(self, queue: deque, timeout: float | None) -> list[dict]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._news:
            while not queue and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._news.wait(remaining)
            items = list(queue)
            queue.clear()
        return items

    def take_stats(self, timeout: float | None) -> list[dict]:
        return self._take(self._stats, timeout)

    def take_kv_events(self, timeout: float | None) -> list[dict]:
        return self._take(self._kv_events, timeout)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._news:
            self._news.notify_all()
        self._thread.join(timeout=5)
        self.executor.shutdown()
        self._fail_all("the engine was shut down")
