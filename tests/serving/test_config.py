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
