"""What every generation route shares: checking the model and the engine, submitting prompts, following
their outputs (merged across prompts, timed for the metrics, aborted when the client goes away), streaming
text that never runs ahead of a stop string, and the pieces of the OpenAI format all routes use."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from raylm.engine_client import EngineDeadError
from raylm.inputs import PromptInputs
from raylm.outputs import CompletionOutput, Logprob, RequestOutput
from raylm.results import GenerationResult, RequestError
from raylm.sampling_params import SamplingParams
from raylm.serving.config import ServingConfig
from raylm.serving.errors import OpenAIError, from_engine_error
from raylm.serving.metrics import ServingMetrics
from raylm.serving.protocol import PromptTokensDetails, Usage

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# nginx's "client closed request": nobody reads it, but logs show why the request ended early.
CLIENT_CLOSED = 499


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def unix_time() -> int:
    return int(time.time())


def sse(payload: BaseModel | dict, event: str | None = None) -> str:
    """One Server-Sent Event: an optional event line and the JSON payload."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def finish_reason(completion: CompletionOutput) -> str | None:
    reason = completion.finish_reason
    return None if reason is None else str(getattr(reason, "value", reason))


def token_text(tokenizer: Any, token: int, logprob: Logprob | None) -> str:
    """A token's text, as its logprob entry decoded it (or decoded now)."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token])


def top_ranked(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The entry's num_top most likely tokens, most likely first (the chosen token only if among them)."""
    ranked = [(token, logprob) for token, logprob in entry.items()
              if logprob.rank is not None and logprob.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank)


@dataclass
class ServingContext:
    """The engine and everything the routes share about it."""

    engine: Any
    config: ServingConfig
    metrics: ServingMetrics
    dead_reason: Callable[[], str | None]

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.engine.info.max_seq_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                              "model", "model_not_found")

    def check_engine(self) -> None:
        reason = self.dead_reason()
        if reason is not None:
            raise OpenAIError(503, f"the engine is not running: {reason}", code="engine_unavailable")

    async def submit(self, prompts: Sequence[PromptInputs], params: SamplingParams, priority: float,
                     cache_salt: str | None, fields: Sequence[str]) -> list[GenerationResult]:
        """Submits every prompt, or none: a rejected prompt aborts those already submitted.

        Errors the engine raises for bad input become 400s whose param is the field they name, if in fields.
        A remote engine checks its input after generate_async returns: its results' admitted() raises what
        generate_async would have, and every submission is awaited before any response starts.
        """
        self.check_engine()
        results: list[GenerationResult] = []
        try:
            for prompt in prompts:
                results.append(self.engine.generate_async(prompt, params, streaming=True, priority=priority,
                                                          cache_salt=cache_salt))
            for result in results:  # all are on their way: awaiting them in turn costs the slowest
                await _admitted(result)
        except (ValueError, TypeError) as exc:
            _abort(results)
            raise from_engine_error(exc, fields) from exc
        except RuntimeError as exc:
            _abort(results)
            if isinstance(exc, EngineDeadError) or self.dead_reason() is not None:
                raise OpenAIError(503, str(exc), code="engine_unavailable") from exc
            raise
        except BaseException:
            _abort(results)
            raise
        return results

    async def follow(self, results: Sequence[GenerationResult]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (prompt index, output) from every result as outputs arrive; each output holds the whole
        state so far. Leaving early (or being cancelled) aborts every request still running."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(index: int, result: GenerationResult) -> None:
            timer = self.metrics.timer()
            try:
                async for output in result:
                    timer.observe(output)
                    queue.put_nowait((index, output))
            except RequestError as exc:
                queue.put_nowait((index, exc))
            queue.put_nowait((index, None))

        tasks = [asyncio.ensure_future(pump(index, result)) for index, result in enumerate(results)]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise self._request_failed(item)
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            _abort(results)

    def _request_failed(self, exc: Exception) -> OpenAIError:
        if self.dead_reason() is not None:
            return OpenAIError(503, f"the engine stopped: {exc}", code="engine_unavailable")
        return OpenAIError(500, f"generation failed: {exc}")

    async def final_outputs(self, results: Sequence[GenerationResult]) -> list[RequestOutput]:
        """The final output of every result, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for index, output in self.follow(results):
            finals[index] = output
        return [finals[index] for index in range(len(results))]


async def _admitted(result: GenerationResult) -> None:
    admitted = getattr(result, "admitted", None)  # only a remote engine's results have it
    if admitted is not None:
        await admitted()


def _abort(results: Sequence[GenerationResult]) -> None:
    for result in results:
        result.abort()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits work, cancelling it when the client disconnects first (OpenAIError 499 then)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the cancellation run to its end (it aborts the requests) before answering.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise OpenAIError(CLIENT_CLOSED, "the client disconnected")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _TextCursor:
    """What one streamed choice has sent so far. (The driver already holds back text that could be the
    start of a stop string, so every character of completion.text is safe to send.)"""

    def __init__(self):
        self.sent_text = 0
        self.sent_tokens = 0
        self.finished = False

    def advance(self, completion: CompletionOutput) -> tuple[str, int]:
        """The text not yet sent that is safe to send, and the index of the first token not yet sent."""
        text = completion.text
        new_text, self.sent_text = text[self.sent_text:], max(self.sent_text, len(text))
        first_token, self.sent_tokens = self.sent_tokens, len(completion.token_ids)
        self.finished = completion.finished
        return new_text, first_token


@dataclass
class StreamDelta:
    """What one choice of one prompt gained since its previous delta."""

    prompt_index: int
    output: RequestOutput  # the whole request so far
    completion: CompletionOutput  # the whole choice so far
    text: str  # new text, safe to send
    first_token: int  # completion.token_ids[first_token:] are new
    is_first: bool  # the choice's first delta

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.completion)


async def stream_deltas(context: ServingContext, results: Sequence[GenerationResult]) -> AsyncIterator[StreamDelta]:
    """Each choice's progress as it happens; a finished choice reports once more, with its finish reason."""
    cursors: dict[tuple[int, int], _TextCursor] = {}
    async for index, output in context.follow(results):
        for completion in output.outputs:
            key = (index, completion.index)
            is_first = key not in cursors
            cursor = cursors.setdefault(key, _TextCursor())
            if cursor.finished:
                continue
            text, first_token = cursor.advance(completion)
            if text or first_token < len(completion.token_ids) or completion.finished or is_first:
                yield StreamDelta(index, output, completion, text, first_token, is_first)


class UsageTally:
    """Token counts of a response: each prompt once, every choice's generated tokens."""

    def __init__(self, count_generated: bool = True):
        self.count_generated = count_generated
        self._prompts: dict[int, tuple[int, int]] = {}
        self._generated: dict[tuple[int, int], int] = {}

    def update(self, prompt_index: int, output: RequestOutput) -> None:
        self._prompts[prompt_index] = (len(output.prompt_token_ids), output.num_cached_tokens)
        for completion in output.outputs:
            generated = len(completion.token_ids) if self.count_generated else 0
            self._generated[(prompt_index, completion.index)] = generated

    def usage(self) -> Usage:
        prompt_tokens = sum(tokens for tokens, _ in self._prompts.values())
        completion_tokens = sum(self._generated.values())
        cached_tokens = sum(cached for _, cached in self._prompts.values())
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))
