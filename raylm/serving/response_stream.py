"""Following the requests of one HTTP response: ResponseStream merges their chunks as they arrive into the
deltas a streamed response sends, and keeps what a whole response needs (each request's RequestProgress:
its prompt, token counts, and each choice's parts, joined once at the end).

Chunks hold only new text and tokens and are never re-joined on the way, so following a request costs time
linear in its tokens however long it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from raylm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from raylm.results import RequestError
from raylm.serving.engine import GenerationStream
from raylm.serving.engine_stream import OutputChunk
from raylm.serving.errors import OpenAIError
from raylm.serving.metrics import RequestTimer, ServingMetrics
from raylm.serving.protocol import PromptTokensDetails, Usage


@dataclass
class ChoiceDelta:
    """What one choice of one prompt gained since its previous delta."""

    prompt_index: int
    request: RequestProgress  # the request so far: its prompt (with logprobs) and token counts
    completion: CompletionOutput  # the choice's index and finish; text, token_ids and logprobs hold only new parts
    is_first: bool  # the choice's first delta


@dataclass
class _Choice:
    """One choice so far: its tokens and logprobs grow in place, its text is joined only when asked."""

    completion: CompletionOutput
    texts: list[str] = field(default_factory=list)

    def extend(self, increment: CompletionOutput) -> None:
        self.texts.append(increment.text)
        self.completion.token_ids.extend(increment.token_ids)
        if increment.logprobs is not None:
            self.completion.logprobs.extend(increment.logprobs)
        self.completion.cumulative_logprob = increment.cumulative_logprob
        self.completion.finish_reason, self.completion.stop_reason = increment.finish_reason, increment.stop_reason
        self.completion.weight_versions = increment.weight_versions

    def whole(self) -> CompletionOutput:
        """The choice so far, in lists of its own: later chunks do not change it."""
        completion = self.completion
        logprobs = list(completion.logprobs) if completion.logprobs is not None else None
        return CompletionOutput(index=completion.index, text="".join(self.texts), token_ids=list(completion.token_ids),
                                cumulative_logprob=completion.cumulative_logprob, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                weight_versions=list(completion.weight_versions))


class RequestProgress:
    """One request as followed so far, folded from its chunks."""

    def __init__(self, prompt_index: int):
        self.prompt_index = prompt_index
        self.request_id = ""
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: TokenLogprobs | None = None
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {}
        self.finished = False
        self._choices: dict[int, _Choice] = {}

    @property
    def generated_lengths(self) -> list[int]:
        """Tokens generated so far by each choice."""
        return [len(choice.completion.token_ids) for choice in self._choices.values()]

    @property
    def finish_reason(self) -> str | None:
        """The first choice's finish reason (None while it runs)."""
        return self._choices[0].completion.finish_reason if 0 in self._choices else None

    def add(self, chunk: OutputChunk) -> list[ChoiceDelta]:
        """Folds a chunk in; returns the deltas worth sending: each choice's first, those of choices that gained
        text or tokens, and a choice's finish (once)."""
        if chunk.first:
            self.prompt, self.prompt_token_ids = chunk.prompt, chunk.prompt_token_ids or []
        if chunk.prompt_logprobs is not None:
            if chunk.whole or self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.request_id, self.finished = chunk.request_id, chunk.finished
        self.num_cached_tokens, self.metrics = chunk.num_cached_tokens, chunk.metrics
        if chunk.whole:
            self._choices = {}
        deltas = []
        for increment in chunk.completions:
            choice = self._choices.get(increment.index)
            is_first = choice is None
            if is_first:
                choice = self._choices[increment.index] = _Choice(CompletionOutput(
                    index=increment.index, logprobs=[] if increment.logprobs is not None else None))
            elif choice.completion.finished:
                continue  # a finished choice stays in every later output, with nothing new
            choice.extend(increment)
            if is_first or increment.text or increment.token_ids or increment.finished:
                deltas.append(ChoiceDelta(self.prompt_index, self, increment, is_first))
        return deltas

    def output(self) -> RequestOutput:
        """The request's whole output so far (its texts joined now)."""
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[self._choices[index].whole() for index in sorted(self._choices)], finished=self.finished,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            num_cached_tokens=self.num_cached_tokens, metrics=self.metrics,
        )


class ResponseStream:
    """The requests of one response, followed together.

    Iterating yields every choice's deltas as their chunks arrive, merged across the requests; each request is
    timed for the metrics, a failed request raises the OpenAIError `failure` makes of it, and leaving early (or
    being cancelled) aborts every request still running. usage() and outputs() tell what has arrived so far.
    """

    def __init__(self, streams: Sequence[GenerationStream], metrics: ServingMetrics,
                 failure: Callable[[Exception], OpenAIError], timers: Sequence[RequestTimer] | None = None):
        self._streams = streams
        # Each request's timer, started when it was submitted (given) or now.
        self._timers = list(timers) if timers is not None else [metrics.timer() for _ in streams]
        self._failure = failure
        self.requests = [RequestProgress(index) for index in range(len(streams))]

    def __aiter__(self) -> AsyncIterator[ChoiceDelta]:
        return self._follow()

    async def _follow(self) -> AsyncIterator[ChoiceDelta]:
        queue: asyncio.Queue[tuple[int, OutputChunk | Exception | None]] = asyncio.Queue()

        async def pump(index: int, stream: GenerationStream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((index, chunk))
            except RequestError as exc:
                queue.put_nowait((index, exc))
            queue.put_nowait((index, None))

        timers = self._timers
        tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(self._streams)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise self._failure(item)
                else:
                    deltas = self.requests[index].add(item)
                    timers[index].observe_chunk(item)
                    timers[index].observe(self.requests[index])
                    for delta in deltas:
                        yield delta
        finally:
            for task in tasks:
                task.cancel()
            for stream in self._streams:
                stream.abort()

    async def run_to_end(self) -> None:
        """Follows every request to its last output."""
        async for _ in self:
            pass

    def outputs(self) -> list[RequestOutput]:
        """Each request's whole output, in prompt order."""
        return [request.output() for request in self.requests]

    def usage(self) -> Usage:
        """The response's token counts so far: each prompt once, every choice's generated tokens."""
        prompt_tokens = sum(len(request.prompt_token_ids) for request in self.requests)
        completion_tokens = sum(sum(request.generated_lengths) for request in self.requests)
        cached_tokens = sum(request.num_cached_tokens for request in self.requests)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
