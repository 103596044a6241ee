"""The engine core: one iteration = schedule, run the model, sample, update requests, report."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.messages import EngineRequest, RequestDelta, StepOutput
from raylm.engine.model_runner import ModelRunner
from raylm.engine.progress import Progress
from raylm.engine.request import FinishReason, Request
from raylm.engine.scheduler import Scheduler
from raylm.engine.stats import iteration_stats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """Engine-side limits, fixed at start-up."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    num_blocks: int
    enable_block_reuse: bool
    enable_chunked_prefill: bool
    event_buffer_max_size: int
    iter_stats_max_iterations: int


class EngineCore:
    def __init__(self, runner: ModelRunner, limits: EngineLimits):
        self.runner = runner
        self.limits = limits
        self.kv_cache = KVCacheManager(limits.num_blocks, limits.block_size, limits.enable_block_reuse,
                                       limits.event_buffer_max_size)
        self.scheduler = Scheduler(self.kv_cache, limits.max_batch_size, limits.max_num_tokens,
                                   limits.enable_chunked_prefill)
        self.progress = Progress(self.scheduler, limits.max_seq_len)
        self.requests: dict[str, Request] = {}
        self.iteration = 0

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add_request(self, engine_request: EngineRequest) -> None:
        if engine_request.request_id in self.requests:
            raise ValueError(f"request id {engine_request.request_id!r} is already in use")
        request = Request(
            request_id=engine_request.request_id,
            prompt_token_ids=list(engine_request.prompt_token_ids),
            sampling_params=engine_request.sampling_params,
            priority=engine_request.priority,
            cache_salt=engine_request.cache_salt,
        )
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str, error: str | None = None) -> RequestDelta | None:
        """Stops a request and frees its blocks; returns its final delta (None if it is unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.sequences:
            seq.finish_reason = seq.finish_reason or FinishReason.ABORT
        self.scheduler.finish_request(request)
        return RequestDelta(request_id, finished=True, error=error)

    def stop_sequence(self, request_id: str, index: int) -> RequestDelta | None:
        """Ends one sequence of a request (the driver saw a stop string); the request ends with its last."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if seq.index == index and not seq.finished:
                seq.finish_reason = FinishReason.STOP
                self.kv_cache.free(seq)
        if request.live_sequences:
            return None
        self.requests.pop(request_id)
        self.scheduler.finish_request(request)
        return RequestDelta(request_id, finished=True)

    def step(self) -> StepOutput:
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return StepOutput()
        try:
            model_output = self.runner.execute(out)
            deltas = self.progress.apply(out, model_output.samples, model_output.prompt_logprobs)
        except Exception as exc:  # a failed step fails its requests, never the engine
            logger.exception("engine step failed")
            failed = {item.request.request_id for item in out.scheduled}
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            deltas = [delta for rid in failed if (delta := self.abort_request(rid, message)) is not None]
        for delta in deltas:
            if delta.finished:
                self.requests.pop(delta.request_id, None)
        self.iteration += 1
        stats = None
        if self.limits.iter_stats_max_iterations:
            num_completed = sum(1 for delta in deltas if delta.finished)
            stats = iteration_stats(self.iteration, time.perf_counter() - start, self.scheduler, self.kv_cache,
                                    out, num_completed, self.runner.device)
        return StepOutput(deltas, stats, self.kv_cache.take_events())
