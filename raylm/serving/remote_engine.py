"""RemoteEngine: the engine deployment seen from the HTTP ingress through its DeploymentHandle, as the ServingEngine
that build_app serves (engine.py).

Each request is one streaming call to the engine deployment, whose chunks (engine_stream.py) go to the routes
as they come; aborting it cancels the call, which aborts the request in the engine and frees its blocks. A call
whose arguments may not fit one gRPC message goes as a Ray actor call instead, its arguments as Ray objects. The
engine's health is polled in the background, so that dead_reason answers at once; a call that fails because the
engine replica died or cannot be reached says so at once too, while a call that fails for its own sake (a
message too large, say) fails its request alone. The RL control (rl_routes.py) goes to every engine replica
(DeploymentHandle.broadcast).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from grpc.aio import AioRpcError
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError

from raylm.config import LlmArgs
from raylm.engine_client import EngineDeadError
from raylm.engine_spec import EngineInfo
from raylm.inputs import PromptInputs, TokensPrompt
from raylm.lora_request import LoRARequest
from raylm.models.source import resolve_model
from raylm.outputs import EncoderOutput
from raylm.results import RequestError
from raylm.sampling_params import SamplingParams
from raylm.serving.engine_stream import Admitted, Failed, OutputChunk, Rejected, chunk_from_wire
from raylm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0
HEALTH_TIMEOUT_S = 3.0
STATS_TIMEOUT_S = 30.0
# Requests whose arguments may pickle to more than this go as Ray actor calls, not over Serve's gRPC channel,
# whose replicas receive messages of 4 MiB at most.
GRPC_REQUEST_BYTES = 1024 * 1024


@dataclass
class EngineDescription:
    """What the ingress learns about the engine once, at start-up."""

    info: EngineInfo
    kv_cache_capacity: dict
    startup_metrics: dict


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, AioRpcError):  # its text's first line says only that an RPC failed
        return f"{type(exc).__name__}: {exc.code().name}: {exc.details()}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _engine_unreachable(exc: BaseException) -> bool:
    """Whether a call failed because the engine deployment cannot take calls (its replica died or cannot be
    reached, or none runs), rather than for a reason of its own."""
    return isinstance(exc, (RayActorError, DeploymentUnavailableError))


def _request_bytes(inputs: PromptInputs, params: SamplingParams) -> int:
    """At least the size of one request's pickled arguments: UTF-8 takes at most 4 bytes a character, pickle at
    most 5 an int."""
    if isinstance(inputs, str):
        text, token_ids = inputs, ()
    elif isinstance(inputs, dict):
        text, token_ids = inputs.get("prompt") or "", inputs.get("prompt_token_ids", ())
    else:
        text, token_ids = "", inputs
    return 4 * len(text) + 5 * len(token_ids) + len(pickle.dumps(params))


class EngineUnreachable(RequestError):
    """A call failed because the engine deployment cannot take calls."""


def _engine_error(exc: BaseException) -> BaseException:
    """The error a Ray call's failure wraps, however deep (the ingress calls the replica, which calls its ranks)."""
    while isinstance(exc, RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


class RemoteGeneration:
    """A request running in the engine deployment, as a GenerationStream (engine.py)."""

    def __init__(self, stream: Any, on_engine_unreachable: Callable[[str], None]):
        self.request_id: str | None = None
        self._stream = stream
        self._on_engine_unreachable = on_engine_unreachable
        self._done = False

    async def admitted(self) -> None:
        """Returns once the engine accepted the request; raises what the engine's generate_async raised for it
        (ValueError or TypeError for bad input, EngineDeadError when it cannot serve)."""
        if self.request_id is not None:
            return
        try:
            message = await self._receive()
        except EngineUnreachable as exc:
            raise EngineDeadError(str(exc)) from exc
        if isinstance(message, Rejected):
            self._done = True
            raise message.error()
        if not isinstance(message, Admitted):
            raise RequestError(f"the engine deployment sent {type(message).__name__} before admitting the request")
        self.request_id = message.request_id

    async def _receive(self) -> Admitted | Rejected | OutputChunk | Failed:
        try:
            message = await self._stream.__anext__()
            return chunk_from_wire(message) if type(message) is tuple else message
        except StopAsyncIteration:
            self._done = True
            raise RequestError("the engine deployment ended the request's stream before its last output") from None
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception as exc:  # the call failed
            if self._done:  # aborted while waiting: the cancellation surfaced here
                raise RequestError("the request was aborted") from exc
            self._done = True
            if _engine_unreachable(exc):
                reason = f"the engine deployment failed: {_first_line(exc)}"
                self._on_engine_unreachable(reason)
                raise EngineUnreachable(reason) from exc
            raise RequestError(f"the engine deployment failed the request: {_first_line(exc)}") from exc

    def abort(self) -> None:
        """Stops the request in the engine (which frees its KV blocks) by cancelling its call."""
        if not self._done:
            self._done = True
            self._stream.cancel()

    async def _chunks(self) -> AsyncIterator[OutputChunk]:
        try:
            await self.admitted()
            while True:
                message = await self._receive()
                if isinstance(message, Failed):
                    self._done = True
                    raise RequestError(message.message)
                self._done = message.finished
                yield message
                if message.finished:
                    return
        finally:
            self.abort()

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._chunks()


class RemoteEngine:
    """A ServingEngine over a DeploymentHandle to EngineDeployment."""

    def __init__(self, handle: Any, tokenizer: Any, description: EngineDescription):
        self._handle = handle
        # Requests stream over the replicas' gRPC channel rather than as Ray objects: each message then costs
        # one send, not an object the ingress must be told of and fetch (about a millisecond per hop here).
        self._stream_handle = handle.options(stream=True, _by_reference=False)
        self._large_stream_handle = handle.options(stream=True, _by_reference=True)
        self.tokenizer = tokenizer
        self.info = description.info
        self.startup_metrics = description.startup_metrics
        self._kv_cache_capacity = description.kv_cache_capacity
        self.dead_reason: str | None = None
        self._health_watch: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where the handle's calls run (connect's)

    @classmethod
    async def connect(cls, handle: Any, args: LlmArgs) -> RemoteEngine:
        """Waits for the engine deployment, loads the tokenizer of `args` here, and starts watching health."""
        description = await handle.describe.remote()
        source = await asyncio.to_thread(resolve_model, args.model, args.revision)
        tokenizer = await asyncio.to_thread(load_tokenizer, args, source)
        engine = cls(handle, tokenizer, description)
        engine._loop = asyncio.get_running_loop()
        engine._health_watch = asyncio.create_task(engine._watch_health())
        return engine

    # ------------------------------------------------------------------ requests

    def stream(self, inputs: PromptInputs, sampling_params: SamplingParams, priority: float,
               cache_salt: str | None, each_step: bool = True,
               lora_request: LoRARequest | None = None) -> RemoteGeneration:
        """Submits one prompt; errors the engine finds in it surface from the stream's admitted()."""
        large = _request_bytes(inputs, sampling_params) > GRPC_REQUEST_BYTES
        handle = self._large_stream_handle if large else self._stream_handle
        call = handle.stream.remote(inputs, sampling_params, priority, cache_salt, each_step, lora_request)
        return RemoteGeneration(call, self._mark_unreachable)

    async def embed(self, prompts: list[TokensPrompt]) -> list[EncoderOutput]:
        """Encodes prompts in one call to the engine deployment (cancelling it aborts them); raises what the
        engine raised for them, EngineDeadError when the deployment cannot take the call."""
        try:
            return await self._handle.embed.remote(prompts)
        except RayTaskError as exc:
            raise _engine_error(exc) from None
        except Exception as exc:
            if _engine_unreachable(exc):
                reason = f"the engine deployment failed: {_first_line(exc)}"
                self._mark_unreachable(reason)
                raise EngineDeadError(reason) from exc
            raise RequestError(f"the engine deployment failed the request: {_first_line(exc)}") from exc

    # ------------------------------------------------------------------ state

    def get_kv_cache_capacity(self) -> dict:
        return dict(self._kv_cache_capacity)

    def get_stats(self, timeout: float | None = 2) -> list[dict]:
        """The engine's iteration statistics since the last call. Blocks: call it from a thread, not the loop.

        The call itself runs on the loop: the replicas route handle calls on their own loop (ray_serve.py), where
        a handle's result can only be awaited."""
        call = asyncio.run_coroutine_threadsafe(self._get_stats(timeout), self._loop)
        return call.result(timeout=(timeout or 0) + STATS_TIMEOUT_S)

    async def _get_stats(self, timeout: float | None) -> list[dict]:
        return await self._handle.get_stats.remote(timeout)

    async def check_health(self) -> str | None:
        """Asks the engine deployment whether its engine runs; the answer (None while it does) is dead_reason."""
        try:
            self.dead_reason = await asyncio.wait_for(self._handle.engine_dead_reason.remote(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.dead_reason = f"the engine deployment did not answer within {HEALTH_TIMEOUT_S:g} s"
        except Exception as exc:
            self.dead_reason = f"the engine deployment is unavailable: {_first_line(exc)}"
        return self.dead_reason

    # ------------------------------------------------------------------ RL control, on every replica

    async def pause_generation(self, mode: str) -> None:
        await self._on_every_replica("pause_generation", mode)

    async def resume_generation(self) -> None:
        await self._on_every_replica("resume_generation")

    async def update_weights(self, weights: dict[str, str] | None) -> None:
        """Hands every replica the same map: each worker takes its own device's payload."""
        await self._on_every_replica("update_weights", weights)

    async def get_weight_version(self) -> int:
        """The lowest replica's: a replica started after an update runs the checkpoint's weights, version 0 (as
        will the first to start when none runs, the deployment scaled to zero)."""
        return min(await self._on_every_replica("get_weight_version"), default=0)

    async def get_device_ids(self) -> list[str]:
        """The device ids of every replica's ranks."""
        return [device for replica in await self._on_every_replica("get_device_ids") for device in replica]

    async def release_memory(self, tags: list[str]) -> None:
        await self._on_every_replica("release_memory", tags)

    async def resume_memory(self, tags: list[str]) -> None:
        await self._on_every_replica("resume_memory", tags)

    async def get_memory_status(self) -> list[list[dict]]:
        """Each replica's ranks' memory status."""
        return await self._on_every_replica("get_memory_status")

    async def _on_every_replica(self, method: str, *args: Any) -> list[Any]:
        """Calls `method` on every engine replica running now, in parallel; one result per replica. A replica's
        error is raised as its engine raised it, not wrapped in Ray's RayTaskError (whose text is a traceback)."""
        try:
            return await self._handle.broadcast(method, *args).results_async()
        except RayTaskError as exc:
            raise _engine_error(exc) from None

    def _mark_unreachable(self, reason: str) -> None:
        # Until the next poll says otherwise: requests failing now answer 503, not 500.
        self.dead_reason = reason

    async def _watch_health(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(HEALTH_POLL_S)

    def shutdown(self) -> None:
        if self._health_watch is not None:
            self._health_watch.cancel()
