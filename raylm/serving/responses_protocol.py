"""The OpenAI wire format of POST /v1/responses (stateless: no stored conversations, no tools): its request,
input items and response object. The shared request pieces are serving/protocol.py's."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from raylm.serving.protocol import ContentPart, PromptTokensDetails, RequestModel, SamplingFields, reject_unsupported


class ResponseInputMessage(RequestModel):
    """An item of the Responses API's input list: a message (earlier output items may be replayed)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None  # ignored: an earlier output item's id
    status: str | None = None  # ignored


class ResponseTextFormat(RequestModel):
    """The Responses API's text.format: OpenAI's response_format with the json_schema fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseTextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type 'json_schema', and allowed only with it")
        return self


class ResponseTextConfig(RequestModel):
    format: ResponseTextFormat | None = None
    verbosity: Any = None

    _unsupported = reject_unsupported("verbosity")


class ResponsesRequest(SamplingFields):
    """POST /v1/responses (stateless: no stored conversations, no tools)."""

    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    tools: Any = None
    tool_choice: Any = None
    text: ResponseTextConfig | None = None
    reasoning: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    include: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    stream_options: Any = None

    _unsupported = reject_unsupported(
        "tools", "tool_choice", "reasoning", "previous_response_id", "conversation", "prompt", "background",
        "include", "truncation", "top_logprobs", "max_tool_calls", "stream_options",
    )


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    output: list[ResponseOutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] | None = None
    usage: ResponseUsage | None = None
