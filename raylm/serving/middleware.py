"""ASGI middleware: the API key check and the bound on generation requests in flight.

Both are plain ASGI so that they see a streamed response through to its end (or the client's disconnect),
which is when a request stops counting as in flight.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

from prometheus_client import Gauge
from starlette.types import ASGIApp, Receive, Scope, Send

from raylm.serving.errors import OpenAIError


def _route(scope: Scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", "")) or "/"


class ApiKeyCheck:
    """Answers 401 unless the request carries 'Authorization: Bearer <api_key>' (every route but the open ones)."""

    def __init__(self, app: ASGIApp, api_key: str, open_routes: Collection[str] = ("/health",)):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_routes = frozenset(open_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route(scope) not in self.open_routes:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing API key" if not given else "incorrect API key"
                error = OpenAIError(401, f"{message}: send the header 'Authorization: Bearer <key>'",
                                    code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InFlightLimit:
    """Answers 429 when max_in_flight generation requests are already being served."""

    def __init__(self, app: ASGIApp, max_in_flight: int, routes: Collection[str], gauge: Gauge):
        self.app = app
        self.max_in_flight = max_in_flight
        self.routes = frozenset(routes)
        self.gauge = gauge
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route(scope) not in self.routes:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_in_flight:
            error = OpenAIError(429, f"the server is at its limit of {self.max_in_flight} requests in flight "
                                     "(max_queue); retry later", code="queue_full")
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        self.gauge.set(self.in_flight)
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.gauge.set(self.in_flight)
