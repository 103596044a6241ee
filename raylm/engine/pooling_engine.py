"""The engine core of an encode_only engine: it batches encode requests dynamically and runs each batch as one
pooling forward (engine/pooling_runner.py).

An encode request is a prefill with no decode. Its whole prompt goes into one forward, never in chunks: an
encoder's token states depend on the tokens after them too, so a chunk cannot be computed before the rest of its
prompt, and there is nothing to keep between steps. That is why this engine has no KV cache, block manager or
sampler. Each iteration takes the waiting requests in arrival order while they fit max_batch_size prompts and
max_num_tokens tokens (the driver refuses a prompt longer than max_num_tokens); requests that arrive while a batch
runs join the next. The engine loop (actors/engine_loop.py) drives it as it drives EngineCore.
"""

from __future__ import annotations

import logging
from collections import deque

from raylm.engine.generation_control import GenerationControl
from raylm.engine.messages import EncodeRequest, RequestDelta, StepOutput
from raylm.engine.pooling_runner import PoolingRunner

logger = logging.getLogger(__name__)


class PoolingEngine(GenerationControl):
    def __init__(self, runner: PoolingRunner, max_batch_size: int, max_num_tokens: int):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.waiting: deque[EncodeRequest] = deque()
        self._ids: set[str] = set()
        self.paused = False
        self.weight_version = 0
        self._control_deltas: list[RequestDelta] = []

    @property
    def has_work(self) -> bool:
        return not self.paused and bool(self.waiting)

    def add_request(self, request: EncodeRequest) -> None:
        if not isinstance(request, EncodeRequest):
            raise ValueError("this engine is encode_only: it encodes prompts (encode) and cannot generate")
        if request.request_id in self._ids:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if len(request.prompt_token_ids) > self.max_num_tokens:
            raise ValueError(f"prompt has {len(request.prompt_token_ids)} tokens, more than max_num_tokens "
                             f"({self.max_num_tokens}): an encoded prompt runs whole in one step")
        self._ids.add(request.request_id)
        self.waiting.append(request)

    def abort_request(self, request_id: str, error: str | None = None, reason: str | None = None
                      ) -> RequestDelta | None:
        """Drops a waiting request; returns its final delta (None if it is unknown or done)."""
        if request_id not in self._ids:
            return None
        self._ids.discard(request_id)
        self.waiting = deque(request for request in self.waiting if request.request_id != request_id)
        return RequestDelta(request_id, finished=True, error=error or reason or "the request was aborted")

    def stop_sequence(self, request_id: str, index: int) -> RequestDelta | None:
        return None  # nothing is generated, so no stop string is ever seen

    def schedule(self) -> list[EncodeRequest]:
        """The next batch: waiting requests in arrival order while they fit the batch and token budgets."""
        batch: list[EncodeRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_batch_size:
            length = len(self.waiting[0].prompt_token_ids)
            if batch and tokens + length > self.max_num_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += length
        return batch

    def step(self) -> StepOutput:
        batch = self.schedule()
        if not batch:
            return StepOutput(weight_version=self.weight_version)
        for request in batch:
            self._ids.discard(request.request_id)
        try:
            embeddings = self.runner.embed([request.prompt_token_ids for request in batch])
        except Exception as exc:  # a failed step fails its requests; the engine goes on
            logger.exception("encode step failed")
            error = f"engine step failed: {type(exc).__name__}: {exc}"
            deltas = [RequestDelta(request.request_id, finished=True, error=error) for request in batch]
        else:
            # Each row is copied out of the batch's tensor, so that a delta pickles only its own values.
            deltas = [RequestDelta(request.request_id, finished=True, embedding=row.clone())
                      for request, row in zip(batch, embeddings)]
        return StepOutput(deltas, weight_version=self.weight_version)

    def drain(self) -> StepOutput | None:
        return None  # steps run to their end: none is ever in flight between iterations

    # ------------------------------------------------------------------ control (ENGINE_CONTROLS)

    def request_ids(self) -> list[str]:
        return list(self._ids)

    def new_weight_version(self) -> int:
        self.weight_version += 1
        return self.weight_version

    def forget_kv(self) -> int:
        return 0  # no KV cache

