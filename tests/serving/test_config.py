"""ServeArgs: LlmArgs plus the server's fields, what it hands the engine and the HTTP layer, its checks, and
the JSON schema shipped with the package."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from raylm import KvCacheConfig, LlmArgs
from raylm.serving.config import SCHEMA_PATH, ServeArgs, ServingConfig, serve_args_schema


def test_the_shipped_schema_equals_the_generated_one():
    assert json.loads(SCHEMA_PATH.read_text()) == serve_args_schema(), (
        "raylm/serving/config_schema.json is stale: regenerate it with "
        "`raylm serve --print_schema > raylm/serving/config_schema.json`")


def test_the_schema_describes_llm_args_and_server_fields_and_rejects_unknown_ones():
    schema = serve_args_schema()
    assert set(LlmArgs.model_fields) | {"served_model_name", "api_key", "max_queue", "host", "port",
                                        "num_replicas", "autoscaling_config", "request_router",
                                        "graceful_shutdown_timeout_s"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["KvCacheConfig"]["additionalProperties"] is False


def test_serve_args_split_into_engine_arguments_and_the_http_config():
    args = ServeArgs(max_batch_size=4, kv_cache_config={"max_tokens": 2048}, api_key="k", max_queue=7)
    kwargs = args.llm_kwargs()
    assert set(kwargs) == set(LlmArgs.model_fields) and kwargs["max_batch_size"] == 4
    assert kwargs["kv_cache_config"] == KvCacheConfig(max_tokens=2048)
    assert args.serving_config() == ServingConfig(served_model_name="smollm2-135m-instruct", api_key="k",
                                                  max_queue=7, profile_dir=args.profile_dir)
    assert ServeArgs(model="/models/x", served_model_name="x").serving_config().served_model_name == "x"


def test_num_replicas_and_autoscaling_exclude_each_other_and_bounds_are_checked():
    with pytest.raises(ValidationError, match="exclude each other"):
        ServeArgs(num_replicas=2, autoscaling_config={"max_replicas": 4})
    with pytest.raises(ValidationError, match="min_replicas must be <= max_replicas"):
        ServeArgs(autoscaling_config={"min_replicas": 3, "max_replicas": 2})
    with pytest.raises(ValidationError, match="port"):
        ServeArgs(port=70000)


def test_prefix_aware_routing_is_the_default_when_several_replicas_may_run_and_needs_block_reuse():
    assert ServeArgs().routing_policy == "pow2"
    assert ServeArgs(num_replicas=2).routing_policy == "prefix_aware"
    assert ServeArgs(autoscaling_config={"max_replicas": 3}).routing_policy == "prefix_aware"
    assert ServeArgs(num_replicas=2, request_router="pow2").routing_policy == "pow2"
    no_reuse = {"enable_block_reuse": False}
    assert ServeArgs(num_replicas=2, kv_cache_config=no_reuse).routing_policy == "pow2"
    with pytest.raises(ValidationError, match="needs kv_cache_config.enable_block_reuse"):
        ServeArgs(num_replicas=2, request_router="prefix_aware", kv_cache_config=no_reuse)
    with pytest.raises(ValidationError, match="request_router"):
        ServeArgs(request_router="round_robin")
    with pytest.raises(ValidationError, match="prefix_routing_max_imbalance"):
        ServeArgs(prefix_routing_max_imbalance=-1)
    # Per model with several: an entry inherits the top level's router unless it sets its own; draining is the
    # whole server's.
    several = ServeArgs(request_router="pow2", models=[{"model": "a", "num_replicas": 2},
                                                       {"model": "b", "num_replicas": 2, "request_router": None}])
    assert [args.routing_policy for args in several.served_models()] == ["pow2", "prefix_aware"]
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s is a setting of the whole server"):
        ServeArgs(models=[{"model": "a", "graceful_shutdown_timeout_s": 5}])


def test_chat_template_is_read_from_a_file_or_taken_as_given(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ServeArgs(chat_template=str(template)).chat_template == template.read_text()
    assert ServeArgs(chat_template="{{ messages }}").chat_template == "{{ messages }}"


def test_the_api_key_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("RAYLM_API_KEY", "from-env")
    assert ServeArgs().api_key == "from-env" and ServeArgs(api_key="given").api_key == "given"
    monkeypatch.delenv("RAYLM_API_KEY")
    assert ServeArgs().api_key is None


TWO_MODELS = [{"model": "/models/llama", "served_model_name": "llama"},
              {"model": "/models/qwen", "served_model_name": "qwen", "max_batch_size": 8, "num_replicas": 2}]


def test_a_config_of_one_model_serves_itself_alone():
    args = ServeArgs(model="/models/x", num_replicas=3)
    assert args.served_models() == [args] and args.most_replicas == 3


def test_each_entry_of_models_takes_the_top_levels_model_settings_unless_it_sets_them(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    args = ServeArgs(models=[*TWO_MODELS, {"model": "/models/big", "autoscaling_config": {"max_replicas": 4},
                                           "chat_template": str(template)}],
                     max_batch_size=4, num_replicas=3, kv_cache_config={"max_tokens": 2048}, dtype="float32",
                     api_key="k", port=9000, tool_call_parser="hermes")
    llama, qwen, big = args.served_models()
    assert [model.model_name for model in (llama, qwen, big)] == ["llama", "qwen", "/models/big"]
    assert [model.max_batch_size for model in (llama, qwen, big)] == [4, 8, 4]
    assert all(model.dtype == "float32" and model.kv_cache_config.max_tokens == 2048 for model in (llama, qwen, big))
    assert all(model.tool_call_parser == "hermes" for model in (llama, qwen, big))
    # num_replicas and autoscaling_config go together: an entry that sets one inherits neither.
    assert [(model.num_replicas, model.most_replicas) for model in (llama, qwen, big)] == [(3, 3), (2, 2), (None, 4)]
    assert big.chat_template == "{{ messages }}"
    assert all(model.models is None and (model.api_key, model.port) == ("k", 9000) for model in (llama, qwen, big))
    assert qwen.serving_config() == ServingConfig(served_model_name="qwen", api_key="k", tool_call_parser="hermes",
                                                  profile_dir=args.profile_dir)


@pytest.mark.parametrize(("fields", "message"), [
    ({"models": [TWO_MODELS[0], {"model": "/other", "served_model_name": "llama"}]},
     "models[0] and models[1] are both served as 'llama': give each entry a distinct served_model_name"),
    ({"models": [{"model": "/models/a"}, {"model": "/models/a"}]}, "both served as '/models/a'"),
    ({"model": "/models/x", "models": TWO_MODELS}, "model and models exclude each other"),
    ({"served_model_name": "x", "models": TWO_MODELS}, "served_model_name and models exclude each other"),
    ({"models": [TWO_MODELS[0], {**TWO_MODELS[1], "port": 9000}]},
     "models[1].port is a setting of the whole server: set it at the top level"),
    ({"models": [TWO_MODELS[0], {**TWO_MODELS[1], "autoscaling_config": {"max_replicas": 3}}]},
     "num_replicas (2) and autoscaling_config exclude each other"),
    ({"models": TWO_MODELS, "enable_rl_endpoints": True}, "enable_rl_endpoints drives one engine"),
    ({"models": []}, "at least 1 item"),
    ({"models": [{**TWO_MODELS[0], "max_batch_sizes": 3}]}, "Extra inputs are not permitted"),
])
def test_bad_lists_of_models_are_rejected_naming_the_field(fields, message):
    with pytest.raises(ValidationError) as info:
        ServeArgs.model_validate(fields)
    assert message in str(info.value)


def test_the_schema_describes_the_entries_of_models():
    schema = serve_args_schema()
    entry = schema["$defs"]["ModelArgs"]
    assert {"model", "served_model_name", "num_replicas", "autoscaling_config", "chat_template",
            "max_batch_size"} <= set(entry["properties"])
    assert not {"api_key", "host", "port", "max_queue", "models"} & set(entry["properties"])
    assert entry["additionalProperties"] is False
