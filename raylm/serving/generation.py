"""The path every generation route shares (ServingContext.respond): checking the model and the engine,
submitting the prompts, then either streaming the route's events as the deltas arrive or collecting the whole
outputs into one response (aborting the requests when the client goes away); and the pieces of the OpenAI
format all routes use.

A route (completions.py, chat_completions.py, responses.py) is a GenerationRoute: the prompts and sampling
parameters of its request body, and how its answer is written.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from raylm.engine_client import EngineDeadError
from raylm.inputs import PromptInputs, TokensPrompt, check_prompt_length, tokenize_prompt
from raylm.lora_request import LoRARequest
from raylm.outputs import CompletionOutput, RequestOutput
from raylm.rl_api import MemoryReleasedError
from raylm.sampling_params import SamplingParams
from raylm.serving.chat import render_chat
from raylm.serving.config import ServingConfig
from raylm.serving.engine import GenerationStream, ServingEngine
from raylm.serving.errors import OpenAIError, from_engine_error, server_error
from raylm.serving.metrics import ServingMetrics
from raylm.serving.protocol import SamplingRequest, Usage
from raylm.serving.response_stream import ChoiceDelta, ResponseStream
from raylm.serving.responses_protocol import ResponsesRequest

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# nginx's "client closed request": nobody reads it, but logs show why the request ended early.
CLIENT_CLOSED = 499

GenerationBody = SamplingRequest | ResponsesRequest


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


@contextmanager
def _field_errors(body: BaseModel) -> Iterator[None]:
    """Turns the ValueError or TypeError raylm raises for a bad value into a 400 whose param is the field of
    `body` that the message names."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise from_engine_error(exc, tuple(type(body).model_fields)) from exc


@contextmanager
def _released_memory_is_unavailable() -> Iterator[None]:
    """A request refused because the engine's device memory is released (POST /release, AsyncLLM.release) is
    fine in itself: the server cannot take it until the memory is resumed, a 503."""
    try:
        yield
    except MemoryReleasedError as exc:
        raise OpenAIError(503, f"the engine cannot generate while its device memory is released; resume it "
                               f"(POST /resume) first: {exc}", code="memory_released") from exc


class GenerationRoute(ABC):
    """One generation route's answer to one request body: what it submits, and how it writes the answer (one
    whole response, or the events of a streamed one)."""

    id_prefix: str  # of the response's id

    def __init__(self, context: ServingContext, body: GenerationBody):
        self.context = context
        self.body = body
        self.response_id = random_id(self.id_prefix)
        self.created = unix_time()

    @abstractmethod
    def prompts(self) -> list[PromptInputs]:
        """The prompts to submit; raises OpenAIError for a body that cannot make them."""

    @abstractmethod
    def sampling_params(self, prompts: list[PromptInputs]) -> SamplingParams:
        """The sampling parameters of every prompt; raises ValueError or TypeError naming a bad field."""

    @abstractmethod
    def response(self, outputs: list[RequestOutput], usage: Usage) -> BaseModel:
        """The whole response, from each prompt's whole output."""

    @abstractmethod
    def events(self, stream: ResponseStream) -> AsyncIterator[str]:
        """The streamed response's Server-Sent Events, as `stream` yields its deltas."""


@dataclass
class ServingContext:
    """The engine and everything the routes share about it."""

    engine: ServingEngine
    config: ServingConfig
    metrics: ServingMetrics
    # The LoRA adapters served as models of their own, by name (lora_modules, then /v1/load_lora_adapter).
    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    last_lora_id: int = 0  # ids are never reused: the engine keys an adapter's slot and cached blocks by its id

    def __post_init__(self) -> None:
        for name, path in self.config.lora_adapters.items():
            self.add_adapter(name, path)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    def add_adapter(self, name: str, path: str) -> LoRARequest:
        """Serves the adapter at `path` as model `name`, under an id no adapter of this server had."""
        if name == self.model_name or name in self.adapters:
            raise OpenAIError(400, f"the model name `{name}` is taken", "lora_name", "model_name_taken")
        self.last_lora_id += 1
        adapter = self.adapters[name] = LoRARequest(name, self.last_lora_id, path)
        return adapter

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model)."""
        return None if model is None or model == self.model_name else self.adapters.get(model)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self.engine.info.max_seq_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and model not in self.adapters:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                              "model", "model_not_found")

    def check_generates(self) -> None:
        """A generation route's 400 on a server whose engine encodes (encode_only) instead of generating."""
        if self.engine.info.pooling is not None:
            raise OpenAIError(400, f"model `{self.model_name}` is an embedding model (encode_only): it serves "
                                   "/v1/embeddings and cannot generate", "model", "model_not_supported")

    def check_engine(self, request_id: str | None = None) -> None:
        reason = self.engine.dead_reason
        if reason is not None:
            raise server_error(503, "the engine is not running", reason, request_id, "engine_unavailable")

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> TokensPrompt:
        """A conversation (and the tools offered, if any) rendered by the chat template, as the prompt to submit."""
        text, token_ids = render_chat(self.tokenizer, messages, self.config.chat_template, add_generation_prompt,
                                      tools)
        return TokensPrompt(prompt_token_ids=token_ids, prompt=text)

    def max_tokens(self, requested: int | None, prompt: TokensPrompt) -> int:
        """`requested`, or OpenAI's default for chat: as many tokens as the context leaves after the prompt."""
        if requested is not None:
            return requested
        return max(1, self.max_seq_len - len(prompt["prompt_token_ids"]))

    async def respond(self, request: Request, route: GenerationRoute) -> Response:
        """Answers `route`'s request: submits its prompts, then streams its events (when the body asks for a
        stream) or answers its whole response once every request has finished."""
        body = route.body
        self.check_model(body.model)
        self.check_generates()
        # Chat templates and tokenizers take seconds over a long input: the loop serves other requests meanwhile.
        prompts, params = await asyncio.to_thread(self._prepare, route)
        timers = [self.metrics.timer() for _ in prompts]  # from the submission on
        streams = await self.submit(prompts, params, body, route.response_id, self.lora_for(body.model))
        stream = ResponseStream(streams, self.metrics, lambda exc: self._request_failed(exc, route.response_id),
                                timers)
        if body.stream:
            return StreamingResponse(route.events(stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await unless_disconnected(request, stream.run_to_end())
        return JSONResponse(route.response(stream.outputs(), stream.usage()).model_dump())

    async def answer(self, route: GenerationRoute) -> BaseModel:
        """`route`'s whole response without an HTTP request (batch jobs, raylm/batch): raises OpenAIError for what
        respond would answer with an error."""
        body = route.body
        self.check_model(body.model)
        self.check_generates()
        prompts, params = await asyncio.to_thread(self._prepare, route)
        timers = [self.metrics.timer() for _ in prompts]  # from the submission on
        streams = await self.submit(prompts, params, body, route.response_id, self.lora_for(body.model))
        stream = ResponseStream(streams, self.metrics, lambda exc: self._request_failed(exc, route.response_id),
                                timers)
        await stream.run_to_end()
        return route.response(stream.outputs(), stream.usage())

    def _prepare(self, route: GenerationRoute) -> tuple[list[TokensPrompt], SamplingParams]:
        """The route's prompts as token ids, each checked to fit max_seq_len, and its sampling parameters.

        Tokenizing here, where the text arrived, means a prompt too long for the engine is answered 400 without
        ever crossing to it, and what crosses is its token ids."""
        prompts = route.prompts()
        with _field_errors(route.body):
            params = route.sampling_params(prompts)
            return [self._tokens_prompt(prompt, params) for prompt in prompts], params

    def _tokens_prompt(self, prompt: PromptInputs, params: SamplingParams) -> TokensPrompt:
        text, token_ids = tokenize_prompt(prompt, self.tokenizer, params.add_special_tokens,
                                          params.truncate_prompt_tokens)
        check_prompt_length(len(token_ids), self.max_seq_len)
        tokens = TokensPrompt(prompt_token_ids=token_ids)
        if text is not None:
            tokens["prompt"] = text
        return tokens

    async def submit(self, prompts: Sequence[PromptInputs], params: SamplingParams, body: GenerationBody,
                     request_id: str, lora_request: LoRARequest | None = None) -> list[GenerationStream]:
        """Submits every prompt, or none: a rejected prompt aborts those already submitted.

        Errors the engine raises for bad input become 400s whose param is the body's field they name. A remote
        engine checks its input after stream() returns, so every submission is admitted before any response
        starts. While the engine's memory is released (POST /release) a prompt answers 503. A server error's
        body names request_id, under which the server log holds its cause.
        """
        self.check_engine(request_id)
        streams: list[GenerationStream] = []
        try:
            with _field_errors(body), _released_memory_is_unavailable():
                for prompt in prompts:
                    streams.append(self.engine.stream(prompt, params, body.priority, body.cache_salt,
                                                      each_step=body.stream, lora_request=lora_request))
                for stream in streams:  # all are on their way: awaiting them in turn costs the slowest
                    await stream.admitted()
        except RuntimeError as exc:
            _abort(streams)
            if isinstance(exc, EngineDeadError) or self.engine.dead_reason is not None:
                raise server_error(503, "the engine is not running", exc, request_id, "engine_unavailable") from exc
            raise server_error(500, "the engine could not take the request", exc, request_id) from exc
        except BaseException:
            _abort(streams)
            raise
        return streams

    def _request_failed(self, exc: Exception, request_id: str) -> OpenAIError:
        if self.engine.dead_reason is not None:
            return server_error(503, "the engine stopped", exc, request_id, "engine_unavailable")
        return server_error(500, "generation failed", exc, request_id)


def _abort(streams: Sequence[GenerationStream]) -> None:
    for stream in streams:
        stream.abort()


async def chunk_events(stream: ResponseStream, body: SamplingRequest,
                       chunk: Callable[[list[Any], Usage | None], BaseModel],
                       choice: Callable[[ChoiceDelta], BaseModel]) -> AsyncIterator[str]:
    """The events of a streamed completion or chat completion: one chunk holding each delta's choice (with the
    usage so far when the body asks for continuous usage), a last chunk of usage alone when it asks for usage,
    an error event if a request fails, then [DONE]."""
    try:
        async for delta in stream:
            yield sse(chunk([choice(delta)], stream.usage() if body.continuous_usage else None))
        if body.include_usage:
            yield sse(chunk([], stream.usage()))
    except OpenAIError as exc:
        yield sse(exc.body())
    yield SSE_DONE


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
