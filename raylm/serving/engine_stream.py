"""One request's outputs as a stream of chunks, the form in which the HTTP routes read them from any engine.

A chunk carries only what its output added to the previous one: the new tokens, text and logprobs, as the
driver's output processor diffed them. Nothing downstream joins or diffs them again, so a long stream costs no
more than its tokens, in this process (LocalEngine) or sent from the engine deployment to the ingress over Ray
Serve (RemoteEngine). Beam search and best_of > n may re-rank their sequences, so their chunks carry whole
outputs.

The engine deployment answers a request with messages: first Admitted, or Rejected with the error its
generate_async raised for the input; then the chunks, or Failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from raylm.engine_client import EngineDeadError
from raylm.inputs import PromptInputs
from raylm.lora_request import LoRARequest
from raylm.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from raylm.results import GenerationResult, RequestError
from raylm.rl_api import MemoryReleasedError
from raylm.sampling_params import SamplingParams

_ERROR_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                            "MemoryReleasedError": MemoryReleasedError,
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
    sent_at: float | None = None  # when the engine deployment sent it (time.time()), to time the hop


def chunk_to_wire(chunk: OutputChunk) -> tuple:
    """The chunk as nested tuples of plain values, as the engine deployment sends it: Serve pickles every message
    with cloudpickle, which costs about three times as much for the dataclasses (and their unpickling five times)
    as for tuples, per streamed token. chunk_from_wire undoes it."""
    return (chunk.request_id, chunk.finished, chunk.num_cached_tokens, chunk.metrics,
            [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason,
              c.weight_versions) for c in chunk.completions],
            chunk.whole, chunk.prompt, chunk.prompt_token_ids, chunk.prompt_logprobs, chunk.first, chunk.sent_at)


def chunk_from_wire(wire: tuple) -> OutputChunk:
    (request_id, finished, num_cached_tokens, metrics, completions, whole, prompt, prompt_token_ids,
     prompt_logprobs, first, sent_at) = wire
    return OutputChunk(
        request_id=request_id, finished=finished, num_cached_tokens=num_cached_tokens, metrics=metrics,
        completions=[CompletionOutput(index=index, text=text, token_ids=token_ids, cumulative_logprob=cumulative,
                                      logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
                                      weight_versions=weight_versions)
                     for index, text, token_ids, cumulative, logprobs, finish_reason, stop_reason, weight_versions
                     in completions],
        whole=whole, prompt=prompt, prompt_token_ids=prompt_token_ids, prompt_logprobs=prompt_logprobs, first=first,
        sent_at=sent_at)


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
                weight_versions=completion.weight_versions,  # sent whole: an entry per weight version, a few at most
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


def merge_chunks(chunks: list[OutputChunk]) -> OutputChunk:
    """One chunk saying what `chunks`, successive chunks of one request, say together: the engine deployment sends
    the chunks that queued up behind a slow send as one message (and the ingress writes one event for them)."""
    if len(chunks) == 1:
        return chunks[0]
    first, last = chunks[0], chunks[-1]
    if last.whole:  # whole outputs: the last says everything
        prompt_logprobs = next((chunk.prompt_logprobs for chunk in reversed(chunks)
                                if chunk.prompt_logprobs is not None), None)
        completions = last.completions
    else:
        prompt_logprobs = None
        joined: dict[int, CompletionOutput] = {}
        for chunk in chunks:
            if chunk.prompt_logprobs is not None:
                prompt_logprobs = (prompt_logprobs or []) + list(chunk.prompt_logprobs)
            for part in chunk.completions:
                sofar = joined.get(part.index)
                if sofar is None:
                    joined[part.index] = CompletionOutput(
                        index=part.index, text=part.text, token_ids=list(part.token_ids),
                        cumulative_logprob=part.cumulative_logprob,
                        logprobs=list(part.logprobs) if part.logprobs is not None else None,
                        finish_reason=part.finish_reason, stop_reason=part.stop_reason,
                        weight_versions=part.weight_versions)
                    continue
                sofar.text += part.text
                sofar.token_ids.extend(part.token_ids)
                if part.logprobs is not None:
                    sofar.logprobs = (sofar.logprobs or []) + list(part.logprobs)
                sofar.cumulative_logprob, sofar.weight_versions = part.cumulative_logprob, part.weight_versions
                sofar.finish_reason, sofar.stop_reason = part.finish_reason, part.stop_reason
        completions = list(joined.values())
    return OutputChunk(request_id=last.request_id, finished=last.finished, num_cached_tokens=last.num_cached_tokens,
                       metrics=last.metrics, completions=completions, whole=last.whole, prompt=first.prompt,
                       prompt_token_ids=first.prompt_token_ids, prompt_logprobs=prompt_logprobs, first=first.first)


async def output_chunks(result: GenerationResult, params: SamplingParams | None) -> AsyncIterator[OutputChunk]:
    """The chunks of a request streaming from an LLM in this process; raises RequestError when the engine fails
    it. Leaving early (or being cancelled) aborts the request, which frees its KV blocks."""
    encoder = ChunkEncoder(outputs_only_grow(params))
    async for output in result:
        yield encoder.encode(output)


async def stream_request(llm: Any, inputs: PromptInputs, params: SamplingParams | None, priority: float,
                         cache_salt: str | None, each_step: bool = True, lora_request: LoRARequest | None = None,
                         ) -> AsyncIterator[Admitted | Rejected | OutputChunk | Failed]:
    """Runs one request on `llm` (an LLM or AsyncLLM) and yields its messages: a chunk per engine step, or with
    each_step False only the last. Closing the iterator early (or cancelling the task that drives it) aborts the
    request, which frees its KV blocks."""
    try:
        result = llm.generate_async(inputs, params, streaming=each_step, priority=priority, cache_salt=cache_salt,
                                    lora_request=lora_request)
    except (ValueError, TypeError, RuntimeError) as exc:
        yield Rejected.from_error(exc)
        return
    yield Admitted(result.request_id)
    try:
        async for chunk in output_chunks(result, params):
            yield chunk
    except RequestError as exc:
        yield Failed(str(exc))
