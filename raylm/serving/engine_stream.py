"""The stream between the engine deployment and the HTTP ingress, one per request.

The engine deployment answers a generate call with messages: first Admitted, or Rejected with the error its
generate_async raised for the input; then one OutputChunk per RequestOutput, or Failed. A chunk carries what
its output added since the previous one (new tokens, text and logprobs), so a long stream costs no more than
its tokens; the ingress rebuilds whole RequestOutputs (ChunkDecoder) and the routes read what a local engine
gives them. Beam search and best_of > n may re-rank their sequences, so their chunks carry whole outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from raylm.engine_client import EngineDeadError
from raylm.inputs import PromptInputs
from raylm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from raylm.results import RequestError
from raylm.sampling_params import SamplingParams

_ERROR_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                            "EngineDeadError": EngineDeadError, "RuntimeError": RuntimeError}


@dataclass
class Admitted:
    """The engine accepted the request."""

    request_id: str


@dataclass
class Rejected:
    """The engine refused the request: the error its generate_async raised, by kind and message."""

    kind: str
    message: str

    @classmethod
    def from_error(cls, exc: Exception) -> Rejected:
        kind = next((name for name, error in _ERROR_KINDS.items() if type(exc) is error), None)
        if kind is None:
            kind = "EngineDeadError" if isinstance(exc, EngineDeadError) else "RuntimeError"
        return cls(kind, str(exc))

    def error(self) -> Exception:
        return _ERROR_KINDS[self.kind](self.message)


@dataclass
class Failed:
    """The engine failed the request after accepting it."""

    message: str


@dataclass
class OutputChunk:
    """One RequestOutput, as what it added to the previous one (or whole, when `whole`)."""

    request_id: str
    finished: bool
    num_cached_tokens: int
    metrics: dict[str, float]
    completions: list[CompletionOutput]  # increments: text, token_ids and logprobs hold only the new part
    whole: bool = False  # completions and prompt_logprobs are complete and replace what came before
    prompt: str | None = None  # the prompt and its ids come with the first chunk only
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: TokenLogprobs | None = None  # entries new since the previous chunk
    first: bool = False  # the request's first chunk


def outputs_only_grow(params: SamplingParams | None) -> bool:
    """Whether each output of a request extends the previous one: true unless the engine may re-rank the
    sequences (beam search, or best_of candidates of which n are kept)."""
    params = params or SamplingParams()
    return not params.use_beam_search and params.num_sequences == params.n


class ChunkEncoder:
    """Turns one request's successive RequestOutputs into chunks (engine side)."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self._first = True
        self._sent_prompt_logprobs = 0

    def encode(self, output: RequestOutput) -> OutputChunk:
        if self.incremental:
            completions = [CompletionOutput(
                index=completion.index, text=completion.text_diff, token_ids=completion.token_ids_diff,
                cumulative_logprob=completion.cumulative_logprob,
                logprobs=completion.logprobs_diff if completion.logprobs is not None else None,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            ) for completion in output.outputs]
        else:
            completions = output.outputs
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            start = 0 if not self.incremental else self._sent_prompt_logprobs
            prompt_logprobs = output.prompt_logprobs[start:]
            self._sent_prompt_logprobs = len(output.prompt_logprobs)
        chunk = OutputChunk(request_id=output.request_id, finished=output.finished,
                            num_cached_tokens=output.num_cached_tokens, metrics=output.metrics,
                            completions=completions, whole=not self.incremental, prompt_logprobs=prompt_logprobs,
                            first=self._first)
        if self._first:
            chunk.prompt, chunk.prompt_token_ids = output.prompt, output.prompt_token_ids
            self._first = False
        return chunk


class ChunkDecoder:
    """Rebuilds one request's whole RequestOutputs from its chunks (ingress side). Every output is a new
    object: the routes may keep earlier ones."""

    def __init__(self):
        self._prompt: str | None = None
        self._prompt_token_ids: list[int] = []
        self._prompt_logprobs: TokenLogprobs | None = None
        self._completions: dict[int, CompletionOutput] = {}

    def decode(self, chunk: OutputChunk) -> RequestOutput:
        if chunk.first:
            self._prompt, self._prompt_token_ids = chunk.prompt, chunk.prompt_token_ids or []
        if chunk.prompt_logprobs is not None:
            kept = [] if chunk.whole or self._prompt_logprobs is None else self._prompt_logprobs
            self._prompt_logprobs = kept + chunk.prompt_logprobs
        if chunk.whole:
            self._completions = {completion.index: completion for completion in chunk.completions}
        else:
            for increment in chunk.completions:
                self._completions[increment.index] = _extend(self._completions.get(increment.index), increment)
        return RequestOutput(
            request_id=chunk.request_id, prompt=self._prompt, prompt_token_ids=self._prompt_token_ids,
            outputs=[self._completions[index] for index in sorted(self._completions)], finished=chunk.finished,
            prompt_logprobs=list(self._prompt_logprobs) if self._prompt_logprobs is not None else None,
            num_cached_tokens=chunk.num_cached_tokens, metrics=chunk.metrics,
        )


def _extend(previous: CompletionOutput | None, increment: CompletionOutput) -> CompletionOutput:
    previous = previous or CompletionOutput(index=increment.index,
                                            logprobs=[] if increment.logprobs is not None else None)
    logprobs = previous.logprobs
    if increment.logprobs is not None:
        logprobs = (logprobs or []) + increment.logprobs
    return dataclasses.replace(
        previous, text=previous.text + increment.text, token_ids=previous.token_ids + increment.token_ids,
        cumulative_logprob=increment.cumulative_logprob, logprobs=logprobs, finish_reason=increment.finish_reason,
        stop_reason=increment.stop_reason, text_diff=increment.text, token_ids_diff=increment.token_ids,
        logprobs_diff=increment.logprobs or [],
    )


async def stream_request(llm: Any, inputs: PromptInputs, params: SamplingParams | None, streaming: bool,
                         priority: float, cache_salt: str | None) -> AsyncIterator[Admitted | Rejected | OutputChunk
                                                                                    | Failed]:
    """Runs one request on `llm` (an LLM or AsyncLLM) and yields its messages. Closing the iterator early (or
    cancelling the task that drives it) aborts the request, which frees its KV blocks."""
    try:
        result = llm.generate_async(inputs, params, streaming=streaming, priority=priority, cache_salt=cache_salt)
    except (ValueError, TypeError, RuntimeError) as exc:
        yield Rejected.from_error(exc)
        return
    yield Admitted(result.request_id)
    encoder = ChunkEncoder(outputs_only_grow(params))
    try:
        async for output in result:
            yield encoder.encode(output)
    except RequestError as exc:
        yield Failed(str(exc))
