"""The OpenAI-compatible server as a Ray Serve application.

    from ray import serve
    from raylm.serving.config import ServeArgs
    from raylm.serving.ray_serve import build_openai_app

    serve.run(build_openai_app(ServeArgs(model="...", tensor_parallel_size=2, num_replicas=2)))

Two deployments. EngineDeployment holds one AsyncLLM whose tp x pp ranks run in the replica's own placement
group: bundle 0 is the replica, bundles 1..world its ranks. OpenAIIngress serves build_app's FastAPI app over a
RemoteEngine, the engine deployment seen through its DeploymentHandle. num_replicas (or autoscaling_config)
applies to both, so each engine has an HTTP front end of its own: that is data parallelism.

A Ray Serve config file deploys the same app with `import_path: raylm.serving.ray_serve:app_builder` and
ServeArgs fields as its `args` (examples/serving/serve_config.yaml).
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve import Application
from ray.serve._private.constants import SERVE_LOGGER_NAME
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raylm.engine_spec import resolve_device
from raylm.inputs import PromptInputs, TokensPrompt
from raylm.outputs import EncoderOutput
from raylm.sampling_params import SamplingParams
from raylm.serving.app import build_app
from raylm.serving.config import ServeArgs
from raylm.serving.engine import encode_all
from raylm.serving.engine_stream import stream_request
from raylm.serving.prefix_router import PrefixAwareRouter
from raylm.serving.remote_engine import EngineDescription, RemoteEngine

logger = logging.getLogger(__name__)

_END = object()  # the end of a request's messages

# Calls an engine replica takes besides generation requests: describe, stats and health polls.
CONTROL_CALLS = 16
# HTTP requests an ingress replica takes besides generation requests (models, metrics, health, ...), so that
# Serve hands every request to the app, which answers 429 beyond max_queue, rather than queueing it.
OTHER_ROUTES = 64
# Serve's default period of load reports for autoscaling.
METRICS_INTERVAL_S = 10.0
# How often a replica being stopped checks whether its requests in flight have finished.
DRAIN_POLL_S = 0.5
# A replica whose constructor fails (a bad model path, say) is retried this often before the deploy fails.
CONSTRUCTOR_RETRIES = 2
# By default Serve runs a replica's code on an event loop in a thread of its own, apart from the replica's loop,
# and routes handle calls from a third: every message of a request changes threads (and waits for the GIL) at each
# hop, which costs milliseconds before the first token while the engine keeps the cores busy. Our replicas never
# block their loop (blocking work goes to threads), so each runs everything on one loop.
ONE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def _set_log_level(args: ServeArgs) -> None:
    logging.getLogger("raylm").setLevel(args.log_level.upper())


@serve.deployment(name="RaylmEngine")
class EngineDeployment:
    """One engine: an AsyncLLM whose ranks take bundles 1..world of this replica's placement group."""

    async def __init__(self, args: ServeArgs):
        from ray.util import get_current_placement_group

        from raylm.rl_api import AsyncLLM

        _set_log_level(args)
        group = get_current_placement_group()
        self.llm = await AsyncLLM(placement_groups=[group],
                                  placement_bundle_indices=[list(range(1, args.world_size + 1))],
                                  **{**args.llm_kwargs(), "executor": "ray"})

    def record_routing_stats(self) -> dict[str, int]:
        """What the request router learns of this replica (Serve polls it): how many tokens its KV cache holds, which
        bounds the prompts prefix-aware routing remembers for it (prefix_router.py)."""
        if self.llm.encode_only:
            return {}
        return {"kv_cache_tokens": self.llm.get_kv_cache_capacity()["maxNumTokens"]}

    def describe(self) -> EngineDescription:
        capacity = {} if self.llm.encode_only else self.llm.get_kv_cache_capacity()
        return EngineDescription(self.llm.info, capacity, self.llm.startup_metrics)

    async def embed(self, prompts: list[TokensPrompt]) -> list[EncoderOutput]:
        """Encodes prompts (an encode_only engine); cancelling the call aborts them. They run in a task of a fresh
        context, for the reason `stream` gives: Serve's recursive cancel would cancel their aborts too."""
        request = contextvars.Context().run(asyncio.ensure_future, encode_all(self.llm, prompts))
        try:
            return await asyncio.shield(request)
        finally:
            request.cancel()  # aborts the prompts unless they have finished

    async def stream(self, inputs: PromptInputs, params: SamplingParams, priority: float,
                     cache_salt: str | None) -> AsyncIterator[Any]:
        """Streams one request's messages (engine_stream); cancelling the call aborts the request.

        Serve cancels a call with ray.cancel(recursive=True), which also cancels every Ray call made from the
        call's context: the engine's submission and, worse, the abort that frees the request's blocks (a
        cancelled call queued on the engine's ordered control channel can even stall the ones after it). So
        the request runs in a task of its own, in a fresh context that Ray sees as no call's child.
        """
        messages: asyncio.Queue = asyncio.Queue()

        async def relay() -> None:
            try:
                async for message in stream_request(self.llm, inputs, params, priority, cache_salt):
                    messages.put_nowait(message)
                messages.put_nowait(_END)
            except Exception as exc:
                messages.put_nowait(exc)

        request = contextvars.Context().run(asyncio.ensure_future, relay())
        try:
            while (message := await messages.get()) is not _END:
                if isinstance(message, Exception):
                    raise message
                yield message
        finally:
            request.cancel()  # aborts the request in the engine unless it has finished

    async def get_stats(self, timeout: float | None) -> list[dict]:
        return await asyncio.to_thread(self.llm.get_stats, timeout)

    def engine_dead_reason(self) -> str | None:
        return self.llm.dead_reason

    # RL control (rl_routes.py), which the ingress broadcasts to every replica (RemoteEngine).

    async def pause_generation(self, mode: str) -> None:
        await self.llm.pause_generation(mode)

    async def resume_generation(self) -> None:
        await self.llm.resume_generation()

    async def update_weights(self, weights: dict[str, str] | None) -> None:
        await self.llm.update_weights(weights)

    def get_weight_version(self) -> int:
        return self.llm.weight_version

    async def get_device_ids(self) -> list[str]:
        return await self.llm.collective_rpc("report_device_id")

    async def release_memory(self, tags: list[str]) -> None:
        await self.llm.release(tags)

    async def resume_memory(self, tags: list[str]) -> None:
        await self.llm.resume(tags)

    async def get_memory_status(self) -> list[dict]:
        return await self.llm.get_memory_status()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is replaced."""
        self.llm.check_health()

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


class CancelledReceiveIsDisconnect:
    """ASGI middleware: under Serve, receive() raises once the proxy cancels a request because its client went
    away; the app expects an http.disconnect message, which ends a streamed response quietly (and aborts the
    request in the engine) instead of logging an error."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_or_disconnect() -> Message:
            try:
                return await receive()
            except (TaskCancelledError, RequestCancelledError):
                return {"type": "http.disconnect"}

        await self.app(scope, receive_or_disconnect, send)


@serve.deployment(name="OpenAIIngress")
@serve.ingress()
class OpenAIIngress:
    """The HTTP front end: build_app's FastAPI app over the engine deployment."""

    async def __init__(self, engine: DeploymentHandle, args: ServeArgs):
        _set_log_level(args)
        self.engine = await RemoteEngine.connect(engine, args)
        self.config = args.serving_config()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_app(self.engine, self.config)
        app.add_middleware(CancelledReceiveIsDisconnect)
        return app

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _replica_options(args: ServeArgs) -> dict[str, Any]:
    # A replica being stopped drains: Serve stops routing to it, then waits (polling every wait loop) until its
    # requests in flight have finished, up to the timeout. Both deployments drain, so a scale-down fails no stream.
    draining = {"graceful_shutdown_timeout_s": args.graceful_shutdown_timeout_s,
                "graceful_shutdown_wait_loop_s": DRAIN_POLL_S}
    scaling = args.autoscaling_config
    if scaling is None:
        return {"num_replicas": args.num_replicas or 1, **draining}
    return {**draining, "autoscaling_config": {
        "min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
        "initial_replicas": scaling.initial_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests or args.max_batch_size,
        "upscale_delay_s": scaling.upscale_delay_s, "downscale_delay_s": scaling.downscale_delay_s,
        "look_back_period_s": scaling.look_back_period_s,
        # Replicas and handles report their load this often: Serve's 10 s, or twice per window when it is shorter.
        "metrics_interval_s": min(METRICS_INTERVAL_S, scaling.look_back_period_s / 2),
    }}


def _request_router_options(args: ServeArgs) -> dict[str, Any]:
    """The engine deployment's request router: every handle to it (the ingress replicas') routes with it."""
    if args.routing_policy != "prefix_aware":
        return {}
    return {"request_router_config": RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={"block_size": args.kv_cache_config.tokens_per_block,
                               "max_imbalance": args.prefix_routing_max_imbalance},
    )}


def _one_loop_runtime_env() -> dict[str, Any]:
    """The job's runtime env (which Serve would give a deployment that sets none) plus ONE_LOOP_ENV, unless the
    job sets those variables itself."""
    import ray

    job_env = dict(ray.get_runtime_context().runtime_env or {}) if ray.is_initialized() else {}
    return {**job_env, "env_vars": {**ONE_LOOP_ENV, **(job_env.get("env_vars") or {})}}


def build_openai_app(config: ServeArgs) -> Application:
    """The Serve application of the OpenAI-compatible server: run it with serve.run or a Serve config file."""
    if config.executor == "local":
        raise ValueError("executor must be 'auto' or 'ray' under Ray Serve: the engine's ranks are Ray actors in "
                         "the replica's placement group, got 'local'")
    args = config.model_copy(update={"device": resolve_device(config.device)})
    rank_bundle = {"GPU": 1.0} if args.device == "cuda" else {"CPU": 1.0}
    actor_options = {"num_cpus": 1, "runtime_env": _one_loop_runtime_env()}
    shared = {"logging_config": {"log_level": args.log_level.upper()},
              "max_constructor_retry_count": CONSTRUCTOR_RETRIES, **_replica_options(args)}
    engine = EngineDeployment.options(
        placement_group_bundles=[{"CPU": 1.0}] + [dict(rank_bundle) for _ in range(args.world_size)],
        placement_group_strategy="PACK",
        ray_actor_options=actor_options,
        max_ongoing_requests=args.max_queue + CONTROL_CALLS,
        health_check_period_s=5,
        **_request_router_options(args),
        **shared,
    ).bind(args)
    return OpenAIIngress.options(
        ray_actor_options=actor_options, max_ongoing_requests=args.max_queue + OTHER_ROUTES, **shared,
    ).bind(engine, args)


def app_builder(args: dict[str, Any]) -> Application:
    """The application of a Ray Serve config (`import_path: raylm.serving.ray_serve:app_builder`); its `args`
    are ServeArgs fields."""
    return build_openai_app(ServeArgs.model_validate(args or {}))


@dataclass
class RunningServer:
    """A deployed app: its URL, and how to take it down."""

    url: str
    app_name: str
    owns_cluster: bool  # this process started the Ray cluster, so stopping ends it

    def stop(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        if self.owns_cluster:
            serve.shutdown()
            ray.shutdown()
        else:
            serve.delete(self.app_name)


def start_server(config: ServeArgs, app_name: str = "raylm",
                 progress: Callable[[str], None] = lambda _: None) -> RunningServer:
    """Deploys the app with Serve's HTTP proxy on config.host:config.port and returns once it serves. It runs
    on the Ray cluster this process is connected to, else the one at RAY_ADDRESS, else on a new local one.
    `progress` hears each stage as it begins; Ray's and Serve's own logs below config.log_level stay quiet."""
    import ray

    from raylm.actors.ray_executor import ensure_ray

    owns_cluster = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if owns_cluster:  # the new cluster's proxy listens on this machine
        check_port_free(config.host, config.port)
    replicas = config.max_replicas
    level = getattr(logging, config.log_level.upper())
    progress("starting a local Ray cluster" if owns_cluster else "connecting to the Ray cluster")
    ensure_ray(replicas * (config.world_size + 2), logging_level=level)
    logging.getLogger(SERVE_LOGGER_NAME).setLevel(level)
    server = RunningServer(f"http://{config.host}:{config.port}", app_name, owns_cluster)
    try:
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config={"log_level": config.log_level.upper()})
        server.url = _http_url(config)
        on_gpus = resolve_device(config.device) == "cuda"
        warm_up = "compiling its kernels and capturing CUDA graphs" if on_gpus else "warming up"
        progress(f"loading {config.model_name} on {replicas} replica(s) of {config.world_size} rank(s), then "
                 f"{warm_up}")
        serve.run(build_openai_app(config), name=app_name, route_prefix="/")
    except BaseException:
        server.stop()
        raise
    return server


def check_port_free(host: str, port: int) -> None:
    """Raises RuntimeError when a server already listens on host:port. Serve's proxy binds with SO_REUSEPORT,
    so a second cluster's proxy would share the port with the first and the kernel split requests between
    them; this bind, without that option, fails instead."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RuntimeError(f"host {host!r} cannot be resolved: {exc.strerror}") from None
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no owner
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise RuntimeError(f"port {port} is in use on {host}: another server listens there; stop it "
                                       f"or choose another --port") from None
                # Any other failure (an address family this host lacks) is Serve's to report.


def _http_url(config: ServeArgs) -> str:
    """Where Serve's HTTP proxy listens: where config asks, unless Serve already ran on the cluster."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    if (http.host, http.port) != (config.host, config.port):
        logger.warning("Serve already runs on this Ray cluster with its HTTP proxy at %s:%s; the app is served "
                       "there, not at %s:%s", http.host, http.port, config.host, config.port)
    return f"http://{http.host}:{http.port}"
