"""Request bodies: the bound on their size (413 beyond ServingConfig.max_request_body_bytes) and their parsing,
which runs in a thread for a large body so that the event loop goes on serving the other requests (/health
among them) meanwhile."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raylm.serving.errors import OpenAIError, bad_request, from_validation_errors

M = TypeVar("M", bound=BaseModel)

# Bodies up to this size are parsed on the event loop: a thread hop would cost more than the parse.
PARSE_IN_THREAD_BYTES = 256 * 1024


def body_too_large(max_bytes: int, size: int | None = None) -> OpenAIError:
    given = f" ({size} bytes)" if size is not None else ""
    return OpenAIError(413, f"the request body{given} is larger than the server's limit of {max_bytes} bytes "
                            "(max_request_body_bytes)", code="request_too_large")


class BodySizeLimit:
    """ASGI middleware: answers 413 for a request whose body is larger than max_bytes, before reading it when it
    declares its Content-Length, else as soon as the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await body_too_large(self.max_bytes, int(declared)).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised into the route reading the body; the app's handler answers it.
                    raise body_too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency: the request body validated as `model`, parsed in a thread when it is large; a body
    that is empty, not valid JSON, or not a valid `model` answers 400 saying what is wrong (Python's JSON reader
    keeps a lone surrogate escape, so that the field holding it is named)."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        if len(raw) <= PARSE_IN_THREAD_BYTES:
            return _validated(model, raw)
        return await asyncio.to_thread(_validated, model, raw)

    parse.body_model = model  # app.py documents the body in /openapi.json
    return parse


def _validated(model: type[M], raw: bytes) -> M:
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object of the request's fields",
                          code="invalid_json")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
