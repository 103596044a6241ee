"""POST /v1/responses: OpenAI's Responses API, stateless and text only.

The input (a string or a list of messages) and the instructions are rendered by the chat template; the
output is one assistant message. Streaming sends the API's events in order: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta
(one per piece of text), response.output_text.done, response.content_part.done, response.output_item.done,
and response.completed (response.incomplete when max_output_tokens cut the text short).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from raylm.inputs import TokensPrompt
from raylm.outputs import RequestOutput
from raylm.results import GenerationResult
from raylm.sampling_params import SamplingParams
from raylm.serving.chat import message_dicts, render_chat
from raylm.serving.errors import OpenAIError, from_engine_error
from raylm.serving.generation import (
    ServingContext,
    UsageTally,
    finish_reason,
    random_id,
    sse,
    stream_deltas,
    unix_time,
    unless_disconnected,
)
from raylm.serving.protocol import (
    PromptTokensDetails,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
)

_FIELDS = tuple(ResponsesRequest.model_fields)


async def create_response(context: ServingContext, body: ResponsesRequest, request: Request) -> Response:
    context.check_model(body.model)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages.extend(message_dicts(body.input, "input"))
    prompt_text, prompt_ids = render_chat(context.tokenizer, messages, context.config.chat_template)
    max_tokens = body.max_output_tokens
    if max_tokens is None:
        max_tokens = max(1, context.max_seq_len - len(prompt_ids))
    try:
        params = SamplingParams(max_tokens=max_tokens, **body.sampling_kwargs())
    except (ValueError, TypeError) as exc:
        raise from_engine_error(exc, _FIELDS) from exc
    prompt = TokensPrompt(prompt_token_ids=prompt_ids, prompt=prompt_text)
    results = await context.submit([prompt], params, body.priority, body.cache_salt, _FIELDS)
    builder = _ResponseBuilder(context, body)
    if body.stream:
        return StreamingResponse(_stream(context, results, builder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    output = (await unless_disconnected(request, context.final_outputs(results)))[0]
    return JSONResponse(builder.final(output).model_dump())


class _ResponseBuilder:
    """The response object at each stage of one request."""

    def __init__(self, context: ServingContext, body: ResponsesRequest):
        self.context = context
        self.body = body
        self.response_id = random_id("resp_")
        self.message_id = random_id("msg_")
        self.created_at = unix_time()

    def response(self, status: str, output: list[ResponseOutputMessage], usage: ResponseUsage | None = None,
                 incomplete_reason: str | None = None) -> ResponseObject:
        body = self.body
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, model=self.context.model_name, status=status,
            incomplete_details={"reason": incomplete_reason} if incomplete_reason else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, output=output,
            temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p,
            metadata=body.metadata, usage=usage,
        )

    def message(self, text: str, status: str) -> ResponseOutputMessage:
        content = [ResponseOutputText(text=text)] if status != "in_progress" else []
        return ResponseOutputMessage(id=self.message_id, status=status, content=content)

    def final(self, output: RequestOutput) -> ResponseObject:
        completion = output.outputs[0]
        cut_short = finish_reason(completion) == "length"
        status = "incomplete" if cut_short else "completed"
        tally = UsageTally()
        tally.update(0, output)
        usage = tally.usage()
        response_usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
            input_tokens_details=usage.prompt_tokens_details or PromptTokensDetails(),
        )
        return self.response(status, [self.message(completion.text, status)], response_usage,
                             "max_output_tokens" if cut_short else None)


async def _stream(context: ServingContext, results: Sequence[GenerationResult],
                  builder: _ResponseBuilder) -> AsyncIterator[str]:
    sequence_numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(sequence_numbers), **fields}, event=kind)

    where = {"item_id": builder.message_id, "output_index": 0, "content_index": 0}
    started = builder.response("in_progress", []).model_dump()
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    yield event("response.output_item.added", output_index=0, item=builder.message("", "in_progress").model_dump())
    yield event("response.content_part.added", part=ResponseOutputText(text="").model_dump(), **where)
    text, final = "", None
    try:
        async for delta in stream_deltas(context, results):
            final = delta.output
            if delta.text:
                text += delta.text
                yield event("response.output_text.delta", delta=delta.text, logprobs=[], **where)
    except OpenAIError as exc:
        error = exc.body()["error"]
        yield event("error", code=error["code"], message=error["message"], param=error["param"])
        return
    response = builder.final(final)
    yield event("response.output_text.done", text=text, logprobs=[], **where)
    yield event("response.content_part.done", part=ResponseOutputText(text=text).model_dump(), **where)
    yield event("response.output_item.done", output_index=0, item=response.output[0].model_dump())
    yield event(f"response.{response.status}", response=response.model_dump())
