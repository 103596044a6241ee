"""The handle generate_async returns: await it for the final output, iterate it for incremental ones.

Outputs arrive on the driver's output thread; sync waiters block on a condition, async waiters are
woken on their own event loop. Cancelling an await (or leaving an `async for` early) aborts the request.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from raylm.outputs import RequestOutput


class RequestError(RuntimeError):
    """The engine failed a request (the message says why)."""


class GenerationResult:
    def __init__(self, request_id: str, streaming: bool, abort: Callable[[str], None]):
        self.request_id = request_id
        self.streaming = streaming
        self._abort = abort
        self._cond = threading.Condition()
        self._pending: deque[RequestOutput] = deque()
        self._latest: RequestOutput | None = None
        self._error: str | None = None
        self._done = False
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # ------------------------------------------------------------------ fed by the output thread

    def push(self, output: RequestOutput) -> None:
        with self._cond:
            self._latest = output
            self._pending.append(output)
            self._done = output.finished
            self._wake()

    def fail(self, error: str) -> None:
        with self._cond:
            self._error = error
            self._done = True
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, future in self._async_waiters:
            loop.call_soon_threadsafe(_resolve, future)
        self._async_waiters.clear()

    # ------------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Stops the request in the engine and frees its blocks."""
        if not self._done:
            self._abort(self.request_id)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RequestError(self._error)

    # ------------------------------------------------------------------ sync

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request finishes and returns its final output."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            self._raise_if_failed()
            return self._latest

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._done)
                if self._pending:
                    output = self._pending.popleft()
                else:
                    self._raise_if_failed()
                    return
            yield output
            if output.finished:
                return

    # ------------------------------------------------------------------ async

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._pending or self._done:
                return
            future = loop.create_future()
            self._async_waiters.append((loop, future))
        try:
            await future
        except asyncio.CancelledError:
            self.abort()
            raise

    async def aresult(self) -> RequestOutput:
        while not self._done:
            await self._wait()
            with self._cond:
                self._pending.clear()
        self._raise_if_failed()
        return self._latest

    def __await__(self):
        return self.aresult().__await__()

    async def _stream(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                await self._wait()
                with self._cond:
                    output = self._pending.popleft() if self._pending else None
                if output is None:
                    self._raise_if_failed()
                    return
                yield output
                if output.finished:
                    return
        finally:
            self.abort()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._stream()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
