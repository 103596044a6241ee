"""build_app: the OpenAI-compatible FastAPI application over one engine, a ServingEngine (engine.py): an LLM
in this process through LocalEngine, or the Ray Serve engine deployment through RemoteEngine (ray_serve.py).
build_models_app serves several engines, each under its own served name: a request's `model` picks the engine
(model_router.py), /v1/models lists them all, and /health, /metrics and /prometheus/metrics cover them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from raylm import __version__
from raylm.lora_request import LoRARequest
from raylm.serving.chat import message_dicts
from raylm.serving.chat_completions import ChatCompletionRoute
from raylm.serving.completions import CompletionRoute
from raylm.serving.config import ModelOptions, ServerOptions, ServingConfig
from raylm.serving.embeddings import EmbeddingRequest, EmbeddingResponse, create_embeddings
from raylm.serving.engine import ServingEngine
from raylm.serving.errors import OpenAIError, bad_request, from_validation_errors, server_error
from raylm.serving.generation import ServingContext, unix_time, unless_disconnected
from raylm.serving.metrics import MetricFamilies, ServingMetrics
from raylm.serving.middleware import ApiKeyCheck, InFlightLimit
from raylm.serving.model_router import ModelRouter
from raylm.serving.profiling import add_profiling_routes
from raylm.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoraAdapterRequest,
)
from raylm.serving.request_body import BodySizeLimit, json_body
from raylm.serving.responses import ResponsesRoute
from raylm.serving.responses_protocol import ResponsesRequest
from raylm.serving.rl_routes import add_rl_routes

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings")


# The settings of the whole server, which every model's ServingConfig repeats.
SERVER_OPTIONS = tuple(name for name in ServerOptions.model_fields if name not in ModelOptions.model_fields)


def build_app(engine: ServingEngine, config: ServingConfig) -> FastAPI:
    """The FastAPI app serving `engine` under `config.served_model_name`, with the profiling routes
    (profiling.py) and the RL routes (rl_routes.py) when config enables them; run it with any ASGI server."""
    return build_models_app([(engine, config)])


def _server_config(models: Sequence[tuple[ServingEngine, ServingConfig]]) -> ServingConfig:
    """The first model's config, whose server settings every model's config must repeat."""
    if not models:
        raise ValueError("a server needs at least one model to serve")
    config = models[0][1]
    for _, other in models[1:]:
        for name in SERVER_OPTIONS:
            if getattr(other, name) != getattr(config, name):
                raise ValueError(f"{name} is a setting of the whole server, the same for every model; model "
                                 f"{other.served_model_name!r} sets another than {config.served_model_name!r}")
    return config


def build_models_app(models: Sequence[tuple[ServingEngine, ServingConfig]]) -> FastAPI:
    """The FastAPI app serving each engine under its config's served_model_name (distinct), in that order in
    /v1/models. The settings of the whole server (api_key, max_queue, the profiling and RL routes, ...) are the
    same in every config; the RL routes drive one engine, so a server of several models cannot enable them."""
    config = _server_config(models)
    families = MetricFamilies()
    router = ModelRouter([ServingContext(engine, each, ServingMetrics(each.served_model_name, families))
                          for engine, each in models])
    if config.enable_rl_endpoints and router.several:
        raise ValueError(f"enable_rl_endpoints drives one engine, so it needs a server of one model, got "
                         f"{len(router.contexts)}")
    created = unix_time()

    app = FastAPI(title="raylm", version=__version__, responses={
        400: {"model": ErrorResponse, "description": "Bad request, in OpenAI's error shape; `param` names the field"}})
    _add_error_handlers(app)
    _document_no_422(app)
    # The bound holds for the whole server: with several models, its series has no model_name.
    in_flight_label = "" if router.several else config.served_model_name
    app.add_middleware(InFlightLimit, max_in_flight=config.max_queue, routes=GENERATION_ROUTES,
                       gauge=families.requests_in_flight.labels(model_name=in_flight_label))
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=config.api_key)

    # ------------------------------------------------------------------ OpenAI routes

    def model_card(context: ServingContext) -> ModelCard:
        return ModelCard(id=context.model_name, created=created, max_model_len=context.max_seq_len)

    def adapter_card(context: ServingContext, adapter: LoRARequest) -> ModelCard:
        return ModelCard(id=adapter.lora_name, created=created, max_model_len=context.max_seq_len,
                         root=adapter.lora_path, parent=context.model_name)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[card for context in router.contexts for card in (
            model_card(context), *(adapter_card(context, adapter) for adapter in context.adapters.values()))])

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> ModelCard:
        context = router.route(model)
        adapter = context.lora_for(model)
        return model_card(context) if adapter is None else adapter_card(context, adapter)

    if config.enable_lora_loading:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoraAdapterRequest = Depends(json_body(LoadLoraAdapterRequest))
                                    ) -> ModelCard:
            """Serves a PEFT adapter as a model of its own from now on; its files are checked against the model
            when its first request arrives (a 400 then, naming what does not fit)."""
            context = router.route(body.model)
            if context.engine.info.pooling is not None:
                raise OpenAIError(400, f"model `{context.model_name}` encodes (encode_only): it takes no LoRA "
                                       "adapters", "model")
            path = Path(body.lora_path)
            if not (path / "adapter_config.json").is_file():
                raise OpenAIError(400, f"lora_path {body.lora_path!r} is not a PEFT adapter directory (no "
                                       "adapter_config.json)", "lora_path")
            return adapter_card(context, context.add_adapter(body.lora_name, body.lora_path))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(
                body: UnloadLoraAdapterRequest = Depends(json_body(UnloadLoraAdapterRequest))) -> dict:
            for context in router.contexts:
                if context.adapters.pop(body.lora_name, None) is not None:
                    return {"unloaded": body.lora_name}
            raise OpenAIError(404, f"no LoRA adapter `{body.lora_name}` is served", "lora_name", "model_not_found")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest = Depends(json_body(CompletionRequest))
                          ) -> Response:
        context = router.route(body.model)
        return await context.respond(request, CompletionRoute(context, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request,
                               body: ChatCompletionRequest = Depends(json_body(ChatCompletionRequest))) -> Response:
        context = router.route(body.model)
        return await context.respond(request, ChatCompletionRoute(context, body))

    @app.post("/v1/responses")
    async def responses(request: Request, body: ResponsesRequest = Depends(json_body(ResponsesRequest))) -> Response:
        context = router.route(body.model)
        return await context.respond(request, ResponsesRoute(context, body))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, body: EmbeddingRequest = Depends(json_body(EmbeddingRequest))
                         ) -> EmbeddingResponse:
        return await unless_disconnected(request, create_embeddings(router.route(body.model), body))

    # ------------------------------------------------------------------ server state

    @app.get("/health")
    async def health() -> dict:
        router.check_engines()
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    def model_info(context: ServingContext) -> dict:
        return {"model": context.model_name, "max_seq_len": context.max_seq_len,
                "kv_cache": context.engine.get_kv_cache_capacity(), "startup_metrics": context.engine.startup_metrics}

    @app.get("/server_info")
    async def server_info() -> dict:
        """Each model's information under `models`; a server of one model gives its fields at the top too."""
        infos = [model_info(context) for context in router.contexts]
        return {**({} if router.several else infos[0]), "version": __version__, "models": infos}

    async def collect_stats() -> None:
        async def collect(context: ServingContext) -> None:
            context.metrics.ingest_iteration_stats(await asyncio.to_thread(context.engine.get_stats, timeout=0))

        await asyncio.gather(*(collect(context) for context in router.contexts))

    @app.get("/metrics")
    async def iteration_stats() -> list[dict]:
        """The engines' iteration statistics since the last call; with several models each names its `model`."""
        await collect_stats()
        if not router.several:
            return router.contexts[0].metrics.take_iteration_stats()
        return [{**stats, "model": context.model_name} for context in router.contexts
                for stats in context.metrics.take_iteration_stats()]

    @app.get("/prometheus/metrics")
    async def prometheus_metrics() -> Response:
        await collect_stats()
        return Response(families.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ tokenizer

    # Both run in a thread: a long text takes seconds to tokenize, during which the loop serves other requests.

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest = Depends(json_body(TokenizeRequest))) -> TokenizeResponse:
        return await asyncio.to_thread(tokenize_body, router.route(body.model), body)

    def tokenize_body(context: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
        if body.messages is not None:
            tokens = context.chat_prompt(message_dicts(body.messages), body.add_generation_prompt)["prompt_token_ids"]
        else:
            tokens = context.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=context.max_seq_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest = Depends(json_body(DetokenizeRequest))) -> DetokenizeResponse:
        return await asyncio.to_thread(detokenize_body, router.route(body.model), body)

    def detokenize_body(context: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
        vocab_size = len(context.tokenizer)
        bad = [token for token in body.tokens if not 0 <= token < vocab_size]
        if bad:
            raise bad_request(f"tokens must be in [0, {vocab_size}), got {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=context.tokenizer.decode(body.tokens))

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> TokenizerInfo:
        """The tokenizer of `model` (a query parameter, which a server of several models needs)."""
        context = router.route(model)
        tokenizer = context.tokenizer
        if tokenizer is None:
            raise OpenAIError(404, f"model `{context.model_name}` has no tokenizer loaded (skip_tokenizer_init)",
                              code="no_tokenizer")
        template = context.config.chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # a tokenizer's named templates: chat requests use the default one
            template = template.get("default")
        return TokenizerInfo(
            tokenizer_class=type(tokenizer).__name__, name_or_path=tokenizer.name_or_path, vocab_size=len(tokenizer),
            bos_token=tokenizer.bos_token, bos_token_id=tokenizer.bos_token_id, eos_token=tokenizer.eos_token,
            eos_token_id=tokenizer.eos_token_id, pad_token=tokenizer.pad_token, pad_token_id=tokenizer.pad_token_id,
            model_max_length=context.max_seq_len, max_seq_len=context.max_seq_len,
            chat_template=template if isinstance(template, str) else None)

    if config.enable_profiling_endpoints:
        add_profiling_routes(app, config.profile_dir)
    if config.enable_rl_endpoints:
        add_rl_routes(app, router.contexts[0])
    return app


def _document_no_422(app: FastAPI) -> None:
    """/openapi.json without FastAPI's 422 and its error models: a body that fails validation gets the 400 every
    route documents (ErrorResponse). Routes that read their body with request_body.json_body get its schema back
    as their requestBody (FastAPI sees only a dependency there)."""
    build_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build_schema()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for route in app.routes:
                model = _json_body_model(route)
                if model is None:
                    continue
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                for method in route.methods:
                    operation = schema["paths"][route.path_format][method.lower()]
                    operation["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _json_body_model(route: Any) -> type | None:
    """The model a route's json_body dependency validates its body as, if it has one."""
    dependant = getattr(route, "dependant", None)
    for dependency in dependant.dependencies if dependant is not None else ():
        model = getattr(dependency.call, "body_model", None)
        if model is not None:
            return model
    return None


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> Response:
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        return OpenAIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return server_error(500, f"internal error serving {request.url.path}", exc).response()
