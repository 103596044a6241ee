"""The OpenAI-compatible server as a Ray Serve application.

    from ray import serve
    from raylm.serving.config import ServeArgs
    from raylm.serving.ray_serve import build_openai_app

    serve.run(build_openai_app(ServeArgs(model="...", tensor_parallel_size=2, num_replicas=2)))

Each engine replica holds one AsyncLLM whose tp x pp ranks run in the replica's own placement group: bundle 0 is
the replica, bundles 1..world its ranks. With ingress 'engine' (and 'auto', the default, for one model on one
replica: ServeArgs.ingress_layout) EngineServer is the one deployment, an engine replica that serves
build_app's FastAPI app itself, so no request crosses between replicas. With ingress 'deployment' there are two:
EngineDeployment, and OpenAIIngress serving the app over a RemoteEngine, the engine deployment seen through its
DeploymentHandle. num_replicas (or autoscaling_config) applies to both, so each engine has an HTTP front end of
its own: that is data parallelism. raylm serve puts HAProxy on the port where it can (http_proxy 'auto').

Several models (ServeArgs.models) are one engine deployment each (RaylmEngine-<index>-<name>), with that model's
engine settings and its own num_replicas or autoscaling_config, behind one OpenAIIngress that holds a RemoteEngine
per model and routes each request by its `model` (build_models_app, model_router.py). One ingress rather than an
app per model, because OpenAI clients reach every model at one base URL and list them with one /v1/models: a
per-model app would need a route prefix per model, or a proxy in front that reads every body twice. The ingress
runs as many replicas as the model that runs the most, so it never bounds one model's scale-out; its replicas
hold no engine, only the tokenizers, so a fixed count costs a CPU each.

A Ray Serve config file deploys the same app with `import_path: raylm.serving.ray_serve:app_builder` and
ServeArgs fields as its `args` (examples/serving/serve_config.yaml).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import re
import time
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
from raylm.lora_request import LoRARequest
from raylm.outputs import EncoderOutput
from raylm.sampling_params import SamplingParams
from raylm.serving.app import build_models_app
from raylm.serving.config import ServeArgs
from raylm.serving.engine import LocalEngine, encode_all
from raylm.serving.engine_stream import OutputChunk, chunk_to_wire, merge_chunks, stream_request
from raylm.serving.http_proxy import (
    check_http_proxy,
    check_port_free,
    cluster_is_this_machine,
    haproxy_binary_env,
    haproxy_ports_env,
    head_is_this_machine,
    http_proxy_env,
    resolve_http_proxy,
)
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


def _queued_chunks(message: Any, messages: asyncio.Queue) -> tuple[list[OutputChunk], Any]:
    """(`message` and the output chunks queued behind it, the first other message or None when the queue ran out):
    chunks that queued up while the previous message was being sent go as one, so under load a request costs a
    message per send the replica gets to, not one per engine step; alone, each chunk goes as soon as it comes."""
    chunks: list[OutputChunk] = []
    while isinstance(message, OutputChunk):
        chunks.append(message)
        message = None if messages.empty() else messages.get_nowait()
    return chunks, message


class EngineReplica:
    """One engine: an AsyncLLM whose ranks take bundles 1..world of this replica's placement group. Deployed as
    EngineDeployment behind the ingress, or as EngineServer with the HTTP app on it."""

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
                     cache_salt: str | None, each_step: bool = True,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[Any]:
        """Streams one request's messages (engine_stream); cancelling the call aborts the request.

        Serve cancels a call with ray.cancel(recursive=True), which also cancels every Ray call made from the
        call's context: the engine's submission and, worse, the abort that frees the request's blocks (a
        cancelled call queued on the engine's ordered control channel can even stall the ones after it). So
        the request runs in a task of its own, in a fresh context that Ray sees as no call's child.
        """
        messages: asyncio.Queue = asyncio.Queue()

        async def relay() -> None:
            try:
                async for message in stream_request(self.llm, inputs, params, priority, cache_salt, each_step,
                                                    lora_request):
                    messages.put_nowait(message)
                messages.put_nowait(_END)
            except Exception as exc:
                messages.put_nowait(exc)

        request = contextvars.Context().run(asyncio.ensure_future, relay())
        try:
            while True:
                chunks, message = _queued_chunks(await messages.get(), messages)
                if chunks:
                    chunk = merge_chunks(chunks)
                    chunk.sent_at = time.time()
                    yield chunk_to_wire(chunk)
                if message is _END:
                    break
                if isinstance(message, Exception):
                    raise message
                if message is not None:
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


EngineDeployment = serve.deployment(name="RaylmEngine")(EngineReplica)


@serve.deployment(name="RaylmServer")
@serve.ingress()
class EngineServer(EngineReplica):
    """An engine replica that serves the HTTP app itself (ingress 'engine'): Serve's proxy hands a request to a
    replica, whose engine answers it in the same process, with no call from an ingress deployment in between."""

    async def __init__(self, args: ServeArgs):
        await super().__init__(args)
        self.config = args.serving_config()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_models_app([(LocalEngine(self.llm), self.config)])
        app.add_middleware(CancelledReceiveIsDisconnect)
        return app


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
    """The HTTP front end: build_models_app's FastAPI app over the engine deployments, one per served model."""

    async def __init__(self, engines: list[DeploymentHandle], models: list[ServeArgs]):
        _set_log_level(models[0])
        self.engines: list[RemoteEngine] = []
        for engine, args in zip(engines, models, strict=True):
            self.engines.append(await RemoteEngine.connect(engine, args))
        self.configs = [args.serving_config() for args in models]

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = build_models_app(list(zip(self.engines, self.configs, strict=True)))
        app.add_middleware(CancelledReceiveIsDisconnect)
        return app

    def __del__(self) -> None:
        for engine in getattr(self, "engines", ()):
            engine.shutdown()


def _replica_options(args: ServeArgs) -> dict[str, Any]:
    """The replica settings of a model's engine deployment (and of the ingress of a server of that model alone)."""
    scaling = args.autoscaling_config
    if scaling is None:
        return {"num_replicas": args.num_replicas or 1}
    return {"autoscaling_config": {
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


def _replica_runtime_env(http_proxy: str) -> dict[str, Any]:
    """The job's runtime env (which Serve would give a deployment that sets none) plus ONE_LOOP_ENV, unless the
    job sets those variables itself, and http_proxy's variables (an ingress replica behind HAProxy serves HTTP
    itself)."""
    import ray

    job_env = dict(ray.get_runtime_context().runtime_env or {}) if ray.is_initialized() else {}
    env_vars = {**ONE_LOOP_ENV, **(job_env.get("env_vars") or {}), **http_proxy_env(http_proxy)}
    return {**job_env, "env_vars": env_vars}


def _ingress_replicas(models: list[ServeArgs]) -> int:
    """Replicas of the ingress at most: as many as the model that runs the most."""
    return max(args.most_replicas for args in models)


def _engine_deployment_name(index: int, args: ServeArgs, several: bool) -> str:
    """RaylmEngine for a server of one model; with several, the model's index and served name (the characters
    Serve allows in a name, others as '_') tell the deployments apart in `serve status`."""
    return f"RaylmEngine-{index}-{re.sub(r'[^A-Za-z0-9._-]', '_', args.model_name)}" if several else "RaylmEngine"


def build_openai_app(config: ServeArgs) -> Application:
    """The Serve application of the OpenAI-compatible server: run it with serve.run or a Serve config file. With
    `models`, one engine deployment per model behind one ingress; with ingress 'engine', the engine replicas
    serve HTTP themselves."""
    models = []
    for args in config.served_models():
        if args.executor == "local":
            raise ValueError(f"executor must be 'auto' or 'ray' under Ray Serve: the engine's ranks are Ray actors "
                             f"in the replica's placement group, got 'local' (model {args.model_name!r})")
        models.append(args.model_copy(update={"device": resolve_device(args.device)}))
    actor_options = {"num_cpus": 1, "runtime_env": _replica_runtime_env(config.http_proxy)}
    # A replica being stopped drains: Serve stops routing to it, then waits (polling every DRAIN_POLL_S) until its
    # requests in flight have finished, up to the timeout. Both deployments drain, so a scale-down fails no stream.
    shared = {"logging_config": {"log_level": config.log_level.upper()},
              "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
              "graceful_shutdown_timeout_s": config.graceful_shutdown_timeout_s,
              "graceful_shutdown_wait_loop_s": DRAIN_POLL_S}
    def placed(args: ServeArgs) -> dict[str, Any]:
        """A replica's placement group: a bundle for the replica itself, one for each rank."""
        rank_bundle = {"GPU": 1.0} if args.device == "cuda" else {"CPU": 1.0}
        return {"placement_group_bundles": [{"CPU": 1.0}] + [dict(rank_bundle) for _ in range(args.world_size)],
                "placement_group_strategy": "PACK", "ray_actor_options": actor_options, "health_check_period_s": 5}

    if config.ingress_layout == "engine":
        [args] = models
        return EngineServer.options(
            max_ongoing_requests=config.max_queue + OTHER_ROUTES, **placed(args), **shared, **_replica_options(args),
        ).bind(args)
    engines = []
    for index, args in enumerate(models):
        engines.append(EngineDeployment.options(
            name=_engine_deployment_name(index, args, len(models) > 1),
            max_ongoing_requests=args.max_queue + CONTROL_CALLS,
            **placed(args), **shared, **_replica_options(args), **_request_router_options(args),
        ).bind(args))
    if config.ingress_replicas is not None:
        ingress_replicas = {"num_replicas": config.ingress_replicas}
    elif len(models) == 1:
        ingress_replicas = _replica_options(models[0])
    else:
        ingress_replicas = {"num_replicas": _ingress_replicas(models)}
    return OpenAIIngress.options(
        ray_actor_options=actor_options, max_ongoing_requests=config.max_queue + OTHER_ROUTES, **shared,
        **ingress_replicas,
    ).bind(engines, models)


def app_builder(args: dict[str, Any]) -> Application:
    """The application of a Ray Serve config (`import_path: raylm.serving.ray_serve:app_builder`); its `args`
    are ServeArgs fields (`models` among them, for several models)."""
    return build_openai_app(ServeArgs.model_validate(args or {}))


@dataclass
class RunningServer:
    """A deployed app: its URL, and how to take it down."""

    url: str
    app_name: str
    owns_cluster: bool  # this process started the Ray cluster, so stopping ends it
    layout: str = ""  # where the app runs and what is on the port, 'auto' resolved: "engine, haproxy"

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
    """Deploys the app behind config.http_proxy on config.host:config.port and returns once it serves. It runs
    on the Ray cluster this process is connected to, else the one at RAY_ADDRESS, else on a new local one.
    `progress` hears each stage as it begins; Ray's and Serve's own logs below config.log_level stay quiet."""
    import ray

    from raylm.actors.ray_executor import ensure_ray

    owns_cluster = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    if owns_cluster:  # the new cluster's proxy listens on this machine
        check_port_free(config.host, config.port)
    check_http_proxy(config.http_proxy)
    models = config.served_models()
    level = getattr(logging, config.log_level.upper())
    progress("starting a local Ray cluster" if owns_cluster else "connecting to the Ray cluster")
    # A CPU for each ingress replica, and for each engine replica one plus a bundle per rank.
    ensure_ray(_ingress_replicas(models) + sum(args.most_replicas * (args.world_size + 1) for args in models),
               logging_level=level)
    logging.getLogger(SERVE_LOGGER_NAME).setLevel(level)
    config = config.model_copy(update={"http_proxy": resolve_http_proxy(config.http_proxy)})
    controller_env = http_proxy_env(config.http_proxy)
    if controller_env and head_is_this_machine():
        controller_env.update(haproxy_ports_env())
    if controller_env and cluster_is_this_machine():
        controller_env.update(haproxy_binary_env())
    server = RunningServer(f"http://{config.host}:{config.port}", app_name, owns_cluster,
                           f"{config.ingress_layout}, {config.http_proxy}")
    try:
        serve.start(http_options={"host": config.host, "port": config.port},
                    logging_config={"log_level": config.log_level.upper()},
                    controller_options={"runtime_env": {"env_vars": controller_env}} if controller_env else None)
        server.url = _http_url(config)
        on_gpus = any(resolve_device(args.device) == "cuda" for args in models)
        warm_up = "compiling its kernels and capturing CUDA graphs" if on_gpus else "warming up"
        loads = ", ".join(f"{args.model_name} on {args.most_replicas} replica(s) of {args.world_size} rank(s)"
                          for args in models)
        front = "HTTP on the engine replica" if config.ingress_layout == "engine" else "HTTP on an ingress deployment"
        proxy = "HAProxy" if config.http_proxy == "haproxy" else "Serve's proxy"
        progress(f"loading {loads} ({front}, {proxy} on the port), then {warm_up}")
        serve.run(build_openai_app(config), name=app_name, route_prefix="/")
    except BaseException:
        server.stop()
        raise
    return server


def _http_url(config: ServeArgs) -> str:
    """Where Serve's HTTP proxy listens: where config asks, unless Serve already ran on the cluster."""
    from ray.serve.context import _get_global_client

    http = _get_global_client().http_config
    if (http.host, http.port) != (config.host, config.port):
        logger.warning("Serve already runs on this Ray cluster with its HTTP proxy at %s:%s; the app is served "
                       "there, not at %s:%s", http.host, http.port, config.host, config.port)
    return f"http://{http.host}:{http.port}"
