"""POST /v1/completions: text or token-id prompts (one or many), n / best_of, echo, logprobs, streaming.

echo with max_tokens=0 returns the prompt alone (with its logprobs when asked, as lm-eval's loglikelihood
needs): the engine generates one token, which the response leaves out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from raylm.outputs import Logprob, RequestOutput, TokenLogprobs
from raylm.results import GenerationResult
from raylm.serving.errors import OpenAIError, from_engine_error
from raylm.serving.generation import (
    SSE_DONE,
    ServingContext,
    StreamDelta,
    UsageTally,
    finish_reason,
    random_id,
    sse,
    stream_deltas,
    token_text,
    top_ranked,
    unix_time,
    unless_disconnected,
)
from raylm.serving.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse

_FIELDS = tuple(CompletionRequest.model_fields)


async def create_completion(context: ServingContext, body: CompletionRequest, request: Request) -> Response:
    context.check_model(body.model)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    prompt_only = body.echo and max_tokens == 0
    try:
        params = body.sampling_params(1 if prompt_only else max_tokens, best_of=body.best_of, logprobs=body.logprobs,
                                      prompt_logprobs=body.logprobs if body.echo else None,
                                      add_special_tokens=body.add_special_tokens)
    except (ValueError, TypeError) as exc:
        raise from_engine_error(exc, _FIELDS) from exc
    results = await context.submit(body.prompts(), params, body.priority, body.cache_salt, _FIELDS)
    formatter = _Formatter(context, body, prompt_only)
    if body.stream:
        return StreamingResponse(_stream(context, body, results, formatter),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await unless_disconnected(request, context.final_outputs(results))
    tally = UsageTally(count_generated=not prompt_only)
    choices = []
    for index, output in enumerate(finals):
        tally.update(index, output)
        for completion in output.outputs:
            choices.append(formatter.choice(index, output, completion.index, completion.text, completion.token_ids,
                                            completion.logprobs, finish_reason(completion), completion.stop_reason,
                                            with_prompt=True))
    response = CompletionResponse(id=formatter.response_id, created=formatter.created, model=context.model_name,
                                  choices=choices, usage=tally.usage())
    return JSONResponse(response.model_dump())


async def _stream(context: ServingContext, body: CompletionRequest, results: Sequence[GenerationResult],
                  formatter: _Formatter) -> AsyncIterator[str]:
    tally = UsageTally(count_generated=not formatter.prompt_only)
    try:
        async for delta in stream_deltas(context, results):
            tally.update(delta.prompt_index, delta.output)
            choice = _delta_choice(formatter, delta)
            usage = tally.usage() if body.continuous_usage else None
            yield sse(formatter.response([choice], usage))
        if body.include_usage:
            yield sse(formatter.response([], tally.usage()))
    except OpenAIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


def _delta_choice(formatter: _Formatter, delta: StreamDelta) -> CompletionChoice:
    completion = delta.completion
    logprobs = completion.logprobs[delta.first_token:] if completion.logprobs is not None else None
    return formatter.choice(delta.prompt_index, delta.output, completion.index, delta.text,
                            completion.token_ids[delta.first_token:], logprobs, delta.finish_reason,
                            completion.stop_reason, with_prompt=delta.is_first)


class _Formatter:
    """Builds the choices of one response; keeps each choice's text offset across stream chunks."""

    def __init__(self, context: ServingContext, body: CompletionRequest, prompt_only: bool):
        self.context = context
        self.body = body
        self.prompt_only = prompt_only
        self.response_id = random_id("cmpl-")
        self.created = unix_time()
        self._text_offsets: dict[int, int] = {}

    def response(self, choices: list[CompletionChoice], usage: Any) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.context.model_name,
                                  choices=choices, usage=usage)

    def choice(self, prompt_index: int, output: RequestOutput, completion_index: int, text: str,
               token_ids: list[int], logprobs: TokenLogprobs | None, reason: str | None,
               stop_reason: int | str | None, with_prompt: bool) -> CompletionChoice:
        """A choice holding the given generated part, preceded by the prompt when echoing and with_prompt."""
        index = prompt_index * self.body.n + completion_index
        if self.prompt_only:
            text, token_ids, logprobs = "", [], []
        parts = [(text, token_ids, logprobs)]
        if self.body.echo and with_prompt:
            prompt_text = output.prompt
            if prompt_text is None:
                prompt_text = self.context.tokenizer.decode(output.prompt_token_ids)
            parts.insert(0, (prompt_text, output.prompt_token_ids, output.prompt_logprobs))
        choice_logprobs = None
        if self.body.logprobs is not None:
            choice_logprobs = CompletionLogprobs()
            for _, part_ids, part_logprobs in parts:
                self._add_logprobs(choice_logprobs, index, part_ids, part_logprobs or [])
        return CompletionChoice(index=index, text="".join(part[0] for part in parts), logprobs=choice_logprobs,
                                finish_reason=reason, stop_reason=stop_reason)

    def _add_logprobs(self, into: CompletionLogprobs, index: int, token_ids: list[int],
                      entries: list[dict[int, Logprob] | None]) -> None:
        num_top = self.body.logprobs or 0
        offset = self._text_offsets.get(index, 0)
        for token, entry in zip(token_ids, entries):
            chosen = entry.get(token) if entry is not None else None
            text = token_text(self.context.tokenizer, token, chosen)
            into.tokens.append(text)
            into.text_offset.append(offset)
            offset += len(text)
            into.token_logprobs.append(chosen.logprob if chosen is not None else None)
            if entry is None:  # the first prompt token: nothing precedes it to predict it
                into.top_logprobs.append(None)
            else:
                into.top_logprobs.append({token_text(self.context.tokenizer, top, logprob): logprob.logprob
                                          for top, logprob in top_ranked(entry, num_top)})
        self._text_offsets[index] = offset
