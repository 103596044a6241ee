"""The routes an RL trainer drives a server with, served when ServingConfig.enable_rl_endpoints is set (off by
default) and, like every route but /health, behind the API key when one is set:

    POST /pause              {"mode": "abort" | "keep"}            stop generating (default abort)
    POST /resume_generation                                        generate again
    POST /update_weights     {"weights": {device_id: payload}}     new weights, any subset, in any number of calls
                             {"weights": null}                     finalize them: the next weight version
    GET  /weight_version     -> {"weight_version": int}
    GET  /device_ids         -> {"device_ids": [str, ...]}         the ids /update_weights keys its payloads by
    POST /release            {"tags": [tag, ...]}                  free these tags' device memory (all when left out)
    POST /resume             {"tags": [tag, ...]}                  bring it back (all when left out)
    GET  /memory_status      -> {"replicas": [[rank, ...], ...]}   each tag's bytes and residency, per rank

Each is the AsyncLLM call of the same name (rl_api/async_llm.py); a payload is a base64 string from
raylm.rl_api.weight_transfer.encode_payload, which the engine's workers unpickle with an allowlist, so a payload
that names anything but tensor-handle pieces answers 400 and changes no weight.

The memory tags are engine/device_memory.py's: model_weights, kv_cache, cuda_graph, model. A body left out, or
one without "tags", means every tag (as vLLM's /sleep and /wake_up do); an unknown tag answers 400 naming the tags.
/release needs generation paused (/pause) while requests run, else it answers 400 and frees nothing; releasing a
released tag, or resuming a resident one, does nothing. While model_weights, kv_cache or model is released,
generation requests answer 503 (code "memory_released") and /resume_generation 400. In /memory_status each rank
is AsyncLLM.get_memory_status's entry: {"tags": {tag: {"bytes": int, "resident": bool}}}, and on GPUs the
device's free and total bytes and what this process holds.

Under Ray Serve (ray_serve.py) each call goes to every engine replica running when it is made (RemoteEngine):
/pause, /resume_generation, /release and /resume act on all of them; /update_weights hands each the same map,
whose workers take their own devices' payloads, so it must hold one for every id /device_ids lists (the ids of all
replicas); /weight_version is the lowest of the replicas'; /memory_status lists one entry per replica (an engine
in this process is one), each its ranks in rank order. A replica that starts later (autoscaling, or the
replacement of one that died) runs the checkpoint's weights at version 0, unpaused and with its memory resident:
a /weight_version that dropped says so, and the trainer sends its weights again. A call that fails on one replica
may have taken effect on the others.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import Field, field_validator

from raylm.engine.device_memory import TAGS, check_tags
from raylm.serving.errors import OpenAIError, bad_request
from raylm.serving.generation import ServingContext
from raylm.serving.protocol import RequestModel

NOT_IMPLEMENTED = 501


class PauseRequest(RequestModel):
    """The body of /pause; it may be left out."""

    mode: Literal["abort", "keep"] = Field(
        default="abort", description="abort: end every running request now (finish_reason 'abort'); keep: park "
                                     "them until /resume_generation, when they go on with the weights then in place.",
    )


class UpdateWeightsRequest(RequestModel):
    """The body of /update_weights."""

    weights: dict[str, str] | None = Field(
        description="Device id (/device_ids) -> base64 payload (weight_transfer.encode_payload), or null to "
                    "finalize the weights sent so far.",
    )

    @field_validator("weights", mode="before")
    @classmethod
    def _payloads_are_strings(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"must map device ids to base64 payloads, or be null to finalize, "
                             f"got {type(value).__name__}")
        for device_id, payload in (value or {}).items():
            if not isinstance(payload, str):
                raise ValueError(f"each payload must be a base64 string (weight_transfer.encode_payload), got "
                                 f"{type(payload).__name__} for device {device_id!r}")
        return value


class MemoryTagsRequest(RequestModel):
    """The body of /release and /resume; it may be left out (every tag)."""

    tags: list[str] = Field(
        default_factory=lambda: list(TAGS),
        description=f"The memory tags to release or resume, of {list(TAGS)}; every tag when left out.",
    )

    @field_validator("tags")
    @classmethod
    def _known_tags(cls, tags: list[str]) -> list[str]:
        return check_tags(tags)


@contextmanager
def _engine_errors(param: str | None = None) -> Iterator[None]:
    """The engine's errors for bad input as 400s (about `param`), and 501 for an engine without RL control."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param) from exc
    except (pickle.UnpicklingError, EOFError) as exc:  # EOFError: an empty or truncated payload
        raise bad_request(f"a weight payload could not be unpickled: {exc}", param) from exc
    except NotImplementedError as exc:
        raise OpenAIError(NOT_IMPLEMENTED, str(exc)) from exc


def add_rl_routes(app: FastAPI, context: ServingContext) -> None:
    """Adds the RL routes over context's engine to `app`."""
    engine = context.engine

    @app.post("/pause")
    async def pause(body: PauseRequest | None = None) -> dict:
        mode = (body or PauseRequest()).mode
        context.check_engine()
        with _engine_errors("mode"):
            await engine.pause_generation(mode)
        return {"paused": True, "mode": mode}

    @app.post("/resume_generation")
    async def resume_generation() -> dict:
        context.check_engine()
        with _engine_errors():
            await engine.resume_generation()
        return {"paused": False}

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> dict:
        context.check_engine()
        with _engine_errors("weights"):
            await engine.update_weights(body.weights)
            return {"weight_version": await engine.get_weight_version()}

    @app.get("/weight_version")
    async def weight_version() -> dict:
        context.check_engine()
        with _engine_errors():
            return {"weight_version": await engine.get_weight_version()}

    @app.get("/device_ids")
    async def device_ids() -> dict:
        context.check_engine()
        with _engine_errors():
            return {"device_ids": await engine.get_device_ids()}

    @app.post("/release")
    async def release(body: MemoryTagsRequest | None = None) -> dict:
        tags = (body or MemoryTagsRequest()).tags
        context.check_engine()
        with _engine_errors():
            await engine.release_memory(tags)
        return {"released": tags}

    @app.post("/resume")
    async def resume(body: MemoryTagsRequest | None = None) -> dict:
        tags = (body or MemoryTagsRequest()).tags
        context.check_engine()
        with _engine_errors():
            await engine.resume_memory(tags)
        return {"resumed": tags}

    @app.get("/memory_status")
    async def memory_status() -> dict:
        context.check_engine()
        with _engine_errors():
            return {"replicas": await engine.get_memory_status()}
