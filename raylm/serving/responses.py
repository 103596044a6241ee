"""POST /v1/responses: OpenAI's Responses API, stateless and text only; text.format json_schema / json_object
decodes the output under structured output (guided_decoding.py), as response_format does for chat.

The input (a string or a list of messages) and the instructions are rendered by the chat template; the
output is one assistant message. Streaming sends the API's events in order: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta
(one per piece of text), response.output_text.done, response.content_part.done, response.output_item.done,
and response.completed (response.incomplete when max_output_tokens cut the text short).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from raylm.inputs import PromptInputs
from raylm.outputs import RequestOutput
from raylm.sampling_params import SamplingParams
from raylm.serving.chat import message_dicts
from raylm.serving.errors import OpenAIError
from raylm.serving.generation import GenerationRoute, ServingContext, finish_reason, random_id, sse
from raylm.serving.guided_decoding import Constraint, guided_decoding
from raylm.serving.protocol import PromptTokensDetails, Usage
from raylm.serving.response_stream import ResponseStream
from raylm.serving.responses_protocol import (
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
)


class ResponsesRoute(GenerationRoute):
    """One Responses API request's prompt, and its response object at each stage."""

    id_prefix = "resp_"
    body: ResponsesRequest

    def __init__(self, context: ServingContext, body: ResponsesRequest):
        super().__init__(context, body)
        self.message_id = random_id("msg_")

    def prompts(self) -> list[PromptInputs]:
        body = self.body
        messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
        if isinstance(body.input, str):
            messages.append({"role": "user", "content": body.input})
        else:
            messages.extend(message_dicts(body.input, "input"))
        return [self.context.chat_prompt(messages)]

    def sampling_params(self, prompts: list[PromptInputs]) -> SamplingParams:
        return SamplingParams(max_tokens=self.context.max_tokens(self.body.max_output_tokens, prompts[0]),
                              guided_decoding=guided_decoding(self._constraints()), **self.body.sampling_kwargs())

    def _constraints(self) -> list[Constraint]:
        """What text.format asks for. The text is not split into reasoning and answer here, so the whole of it is
        constrained."""
        text_format = self.body.text.format if self.body.text is not None else None
        if text_format is None or text_format.type == "text":
            return []
        if text_format.type == "json_object":
            return [("text.format", {"json_object": True})]
        return [("text.format.schema", {"json": text_format.schema_})]

    def _object(self, status: str, output: list[ResponseOutputMessage], usage: ResponseUsage | None = None,
                incomplete_reason: str | None = None) -> ResponseObject:
        body = self.body
        return ResponseObject(
            id=self.response_id, created_at=self.created, model=self.context.model_name, status=status,
            incomplete_details={"reason": incomplete_reason} if incomplete_reason else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens, output=output,
            temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p,
            metadata=body.metadata, usage=usage,
            **({"text": body.text.model_dump(by_alias=True, exclude_none=True)} if body.text is not None else {}),
        )

    def _message(self, text: str, status: str) -> ResponseOutputMessage:
        content = [ResponseOutputText(text=text)] if status != "in_progress" else []
        return ResponseOutputMessage(id=self.message_id, status=status, content=content)

    def response(self, outputs: list[RequestOutput], usage: Usage) -> ResponseObject:
        completion = outputs[0].outputs[0]
        cut_short = finish_reason(completion) == "length"
        status = "incomplete" if cut_short else "completed"
        response_usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
            input_tokens_details=usage.prompt_tokens_details or PromptTokensDetails(),
        )
        return self._object(status, [self._message(completion.text, status)], response_usage,
                            "max_output_tokens" if cut_short else None)

    async def events(self, stream: ResponseStream) -> AsyncIterator[str]:
        sequence_numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            return sse({"type": kind, "sequence_number": next(sequence_numbers), **fields}, event=kind)

        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        started = self._object("in_progress", []).model_dump()
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        yield event("response.output_item.added", output_index=0, item=self._message("", "in_progress").model_dump())
        yield event("response.content_part.added", part=ResponseOutputText(text="").model_dump(), **where)
        try:
            async for delta in stream:
                if delta.completion.text:
                    yield event("response.output_text.delta", delta=delta.completion.text, logprobs=[], **where)
        except OpenAIError as exc:
            error = exc.body()["error"]
            yield event("error", code=error["code"], message=error["message"], param=error["param"])
            return
        response = self.response(stream.outputs(), stream.usage())
        text = response.output[0].content[0]
        yield event("response.output_text.done", text=text.text, logprobs=[], **where)
        yield event("response.content_part.done", part=text.model_dump(), **where)
        yield event("response.output_item.done", output_index=0, item=response.output[0].model_dump())
        yield event(f"response.{response.status}", response=response.model_dump())
