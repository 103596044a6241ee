"""The OpenAI wire format: pydantic models of the requests and responses the server speaks.

Requests are strict: a number is never a string or a bool, and a field the model does not declare is an
error (400), so nothing that would change the output is dropped silently. Three kinds of declared fields:
- implemented: mapped onto SamplingParams or the prompt;
- ignored: OpenAI fields that do not change the output (user, metadata, store, ...), accepted and unused;
- unsupported: OpenAI fields raylm does not implement yet (logit_bias, audio, ...), answered 400 unless they
  hold a value that changes nothing (null, [], {}, "none", ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raylm.sampling_params import SamplingParams

# Values of unsupported fields that ask for nothing beyond what raylm does anyway.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "tool_choice": ("none",),
    "modalities": (["text"],),
    "truncation": ("disabled",),
    "background": (False,),
    "top_logprobs": (0,),
    "start_step": (0,),
}


def reject_unsupported(*names: str) -> Any:
    """A field validator answering 400 when one of the named fields asks for something raylm lacks."""

    def check(cls: type, value: Any, info: Any) -> Any:
        if value is None or value == [] or value == {} or value in _NO_OP_VALUES.get(info.field_name, ()):
            return value
        raise ValueError(f"raylm does not support `{info.field_name}` yet")

    return field_validator(*names)(check)


def _lone_surrogate(value: Any) -> str | None:
    """Where a lone surrogate (U+D800..U+DFFF, which JSON's \\ud800 escapes can carry but no UTF-8 text holds)
    sits in value's strings, if anywhere: the tokenizer cannot encode it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"U+{ord(value[exc.start]):04X} at character {exc.start}"
        return None
    if isinstance(value, BaseModel):
        value = list(value.__dict__.values())
    elif isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    elif not isinstance(value, list):
        return None
    for item in value:
        if isinstance(item, (str, list, dict, BaseModel)):
            found = _lone_surrogate(item)
            if found is not None:
                return found
    return None


def _require_valid_unicode(value: Any) -> Any:
    found = _lone_surrogate(value)
    if found is not None:
        raise ValueError(f"text must be valid Unicode, but it holds a lone surrogate ({found})")
    return value


class RequestModel(BaseModel):
    """A request body: strict types, no undeclared fields, and text that is valid Unicode."""

    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    _valid_unicode = field_validator("*")(lambda cls, value: _require_valid_unicode(value))


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: Any = None  # ignored: padding against side channels; the text is unchanged


class SamplingFields(RequestModel):
    """Decoding fields every generation endpoint shares; top_k onwards are raylm extensions."""

    model: str
    temperature: float | None = None  # OpenAI's default, 1.0, when unset
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: float = 0.5
    cache_salt: str | None = None
    # Ignored: they do not change the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # chat reads it with tool_choice "required" (tools.py)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        return dict(
            temperature=1.0 if self.temperature is None else self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
        )


class JsonSchemaFormat(RequestModel):
    """response_format's json_schema: the schema the output must validate against."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # raylm always decodes under the schema


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and allowed only with it")
        return self


class SamplingRequest(SamplingFields):
    """Fields of /v1/completions and /v1/chat/completions beyond the shared ones."""

    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Any = None
    # Structured output (guided_decoding.py): at most one of them.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    _unsupported = reject_unsupported("logit_bias")

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int, **extra: Any) -> SamplingParams:
        """The engine's SamplingParams; raises ValueError/TypeError naming the field when a value is out of range."""
        return SamplingParams(
            max_tokens=max_tokens, n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, **self.sampling_kwargs(), **extra,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


# ---------------------------------------------------------------------------------------------- completions

_PROMPT_SHAPE = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    suffix: Any = None

    _unsupported = reject_unsupported("logit_bias", "suffix")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: Any) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:
            _require_valid_unicode(value)  # when the shape is right but the text is not, that is the error
            raise ValueError(_PROMPT_SHAPE) from None
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @model_validator(mode="after")
    def _best_of_cannot_stream(self) -> CompletionRequest:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot be streamed: the best sequences are known only at the end")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (with usage unset until the last) each chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------------------------- chat


class ContentPart(BaseModel):
    """One part of a message's content; only {"type": "text"} parts are supported (chat.py says so)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


_TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class FunctionCall(RequestModel):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object's text, as OpenAI sends it


class ToolCallParam(RequestModel):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None
    reasoning_content: str | None = None  # an earlier answer's thinking; chat templates drop or keep it

    _unsupported = reject_unsupported("function_call", "audio", "refusal")

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to {self.role!r} ones")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a message of role 'tool' needs tool_call_id (the call it answers), and only it takes one")
        return self


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # raylm decodes under the schema when tool_choice demands a call (tools.py)


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str = Field(min_length=1)


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    _unsupported = reject_unsupported(
        "logit_bias", "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
        "web_search_options", "verbosity",
    )

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice_shape(cls, value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": NAME}}') from None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role", "content", "reasoning_content", "tool_calls"}: only those with news
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error the server answers (errors.py)."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- other routes


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "raylm"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's directory
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoraAdapterRequest(RequestModel):
    """POST /v1/load_lora_adapter: serve the PEFT adapter at lora_path as model lora_name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = Field(default=None, description="The base model (needed on a server of several).")


class UnloadLoraAdapterRequest(RequestModel):
    """POST /v1/unload_lora_adapter: stop serving adapter lora_name (requests running with it finish)."""

    lora_name: str = Field(min_length=1)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class TokenizerInfo(BaseModel):
    """GET /tokenizer_info: what a client needs to tokenize for this server itself (lm-eval asks for it)."""

    tokenizer_class: str
    name_or_path: str
    vocab_size: int  # special tokens included
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None
    pad_token_id: int | None
    model_max_length: int  # the server's max_seq_len: prompt and generated tokens together
    max_seq_len: int
    chat_template: str | None  # the one chat requests are rendered with


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
