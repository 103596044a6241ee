"""The app's routes over a live engine: models, errors in OpenAI's shape, health, version and server info,
iteration stats and Prometheus metrics, and the tokenizer routes."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import raylm
from raylm.serving import LocalEngine
from tests.serving.conftest import MODEL

ERROR_FIELDS = {"message", "type", "param", "code"}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
RESPONSE = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}


def _post(base_url: str, route: str, body: dict | bytes) -> httpx2.Response:
    if isinstance(body, bytes):
        return httpx2.post(f"{base_url}{route}", content=body, headers={"content-type": "application/json"},
                           timeout=60)
    return httpx2.post(f"{base_url}{route}", json=body, timeout=60)


def _error(response: httpx2.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS
    return body["error"]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 1024
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "temperature": True}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "prompt": 5}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {**COMPLETION, "prompt": [999999]}, 400, "prompt", None),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {**COMPLETION, "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {**COMPLETION, "max_tokens": 5000}, 400, "max_tokens", None),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, 400, "seed", None),
    ("/v1/completions", {**COMPLETION, "seed": -(2**63) - 1}, 400, "seed", None),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", b'"\\ud800"', 400, None, "invalid_value"),
    ("/v1/completions", b'{"model": "smollm2-test", "prompt": "a\\ud800"}', 400, "prompt", "invalid_value"),
    ("/v1/completions", b'{"model": "smollm2-test", "prompt": ["ok", "\\udfff"]}', 400, "prompt", "invalid_value"),
    ("/v1/chat/completions", b'{"model": "smollm2-test", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "messages.0.content", "invalid_value"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt", "invalid_value"),
    ("/v1/completions", {**COMPLETION, "prompt": "hello " * 1500}, 400, "prompt", None),
    ("/v1/completions", {**COMPLETION, "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n", None),
    ("/v1/completions", {**COMPLETION, "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, None, "invalid_value"),
    ("/v1/completions", {**COMPLETION, "best_of": 2, "stream": True}, 400, None, "invalid_value"),
    ("/v1/completions", {**COMPLETION, "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"42": -100}}, 400, "logit_bias", "unsupported_parameter"),
    ("/v1/completions", {**COMPLETION, "frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "Hello"}, 400, "model", "missing_required_parameter"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function",
     "missing_required_parameter"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice", "invalid_value"),  # 'auto' on a server without a tool_call_parser
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "1"}]}, 400, "messages.0",
     "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "function", "name": "f", "content": "1"}]}, 400,
     "messages.0.role", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages.0.content.0.type",
     "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, None, "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/responses", {**RESPONSE, "previous_response_id": "resp_1"}, 400, "previous_response_id",
     "unsupported_parameter"),
    ("/v1/responses", {**RESPONSE, "tools": [{"type": "web_search"}]}, 400, "tools", "unsupported_parameter"),
    ("/v1/responses", {**RESPONSE, "text": {"format": {"type": "json_schema"}}}, 400, "text.format",
     "invalid_value"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(base_url, route, body, status, param, code):
    error = _error(_post(base_url, route, body), status)
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"]


def test_empty_non_object_and_lone_surrogate_bodies_get_messages_saying_what_is_wrong(base_url):
    assert "request body is empty" in _error(_post(base_url, "/v1/completions", b""), 400)["message"]
    assert _error(_post(base_url, "/v1/completions", b'["x"]'), 400)["message"] == (
        "the request body must be a JSON object, got an array")
    message = _error(_post(base_url, "/v1/completions", b'{"model": "smollm2-test", "prompt": "ab\\ud800"}'),
                     400)["message"]
    assert message == "prompt: text must be valid Unicode, but it holds a lone surrogate (U+D800 at character 2)"


def test_a_disallowed_method_is_a_405_with_an_allow_header(base_url):
    response = httpx2.get(f"{base_url}/v1/completions")
    _error(response, 405)
    assert response.headers["allow"] == "POST"


def test_openapi_documents_the_400_error_body_and_no_422(base_url):
    schema = httpx2.get(f"{base_url}/openapi.json").json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"] == error_ref
    assert "422" not in json.dumps(schema["paths"])
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    assert set(components["ErrorInfo"]["properties"]) == ERROR_FIELDS


def test_openapi_documents_each_request_body_with_its_schema(base_url):
    """Bodies are parsed by a dependency of the server's own (request_body.json_body), which /openapi.json still
    documents: clients and fuzzers generate requests from it."""
    schema = httpx2.get(f"{base_url}/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/responses", "ResponsesRequest"), ("/tokenize", "TokenizeRequest")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "prompt" in components[model]["properties"] or "messages" in components[model]["properties"] \
            or "input" in components[model]["properties"]
    refs = {ref.rsplit("/", 1)[-1] for ref in json.dumps(schema).split('"$ref": "')[1:] for ref in [ref.split('"')[0]]}
    assert refs <= set(components)  # every reference resolves


def test_tokenizer_info_reports_the_special_tokens_lengths_and_chat_template(base_url, llm):
    info = httpx2.get(f"{base_url}/tokenizer_info").json()
    tokenizer = llm.tokenizer
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["eos_token_id"]) == (tokenizer.eos_token, tokenizer.eos_token_id)
    assert info["eos_token_id"] == tokenizer.convert_tokens_to_ids(info["eos_token"])
    assert (info["bos_token"], info["bos_token_id"]) == (tokenizer.bos_token, tokenizer.bos_token_id)
    assert (info["pad_token"], info["pad_token_id"]) == (tokenizer.pad_token, tokenizer.pad_token_id)
    assert info["model_max_length"] == info["max_seq_len"] == 1024
    assert info["vocab_size"] == len(tokenizer)
    assert info["chat_template"] == tokenizer.chat_template and "{%" in info["chat_template"]


def test_server_keeps_serving_after_bad_requests_and_unsupported_options_raise_in_the_client(client, base_url):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], logit_bias={"42": -100})
    assert "logit_bias" in info.value.message
    assert "max_seq_len" in _error(_post(base_url, "/v1/completions", {**COMPLETION, "max_tokens": 5000}), 400)[
        "message"]
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_ignored_openai_fields_and_no_op_values_are_accepted(base_url):
    ignored = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    no_ops = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logit_bias": {}}
    assert _post(base_url, "/v1/chat/completions", {**CHAT, **ignored, **no_ops}).status_code == 200
    assert _post(base_url, "/v1/completions", {**COMPLETION, "user": "u-1"}).status_code == 200
    assert _post(base_url, "/v1/responses", {**RESPONSE, **ignored}).status_code == 200


def test_unknown_route_is_a_404_in_openai_shape(base_url):
    _error(httpx2.get(f"{base_url}/v1/nothing-here"), 404)


def test_health_is_503_while_the_engine_is_down(client, base_url, monkeypatch):
    healthy = httpx2.get(f"{base_url}/health")
    assert healthy.status_code == 200 and healthy.json() == {"status": "ok"}
    monkeypatch.setattr(LocalEngine, "dead_reason", property(lambda engine: "engine loop died: test"))
    assert "the engine is not running" in _error(httpx2.get(f"{base_url}/health"), 503)["message"]
    assert _error(_post(base_url, "/v1/completions", COMPLETION), 503)["type"] == "server_error"
    monkeypatch.undo()
    assert httpx2.get(f"{base_url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).choices[0].text


def test_version_and_server_info(base_url):
    assert httpx2.get(f"{base_url}/version").json() == {"version": raylm.__version__}
    info = httpx2.get(f"{base_url}/server_info").json()
    assert info["model"] == MODEL and info["max_seq_len"] == 1024
    assert info["kv_cache"]["maxNumBlocks"] * info["kv_cache"]["tokensPerBlock"] == 4096
    assert info["startup_metrics"]["total_llm_creation_seconds"] > 0


def _prometheus(base_url: str) -> dict:
    text = httpx2.get(f"{base_url}/prometheus/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


def _sample(families: dict, family: str, suffix: str = "") -> float:
    return sum(s.value for s in families[family].samples if s.name == family + suffix)


def test_iteration_stats_and_prometheus_metrics_follow_the_requests(client, base_url):
    before = _prometheus(base_url)
    response = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                         temperature=0)
    stats = httpx2.get(f"{base_url}/metrics").json()
    assert stats and all({"iter", "iterLatencyMS", "numActiveRequests", "kvCacheStats"} <= set(s) for s in stats)
    assert httpx2.get(f"{base_url}/metrics").json() == []  # each iteration is reported once
    after = _prometheus(base_url)
    assert _sample(after, "raylm_prompt_tokens", "_total") - _sample(before, "raylm_prompt_tokens", "_total") == (
        response.usage.prompt_tokens)
    assert _sample(after, "raylm_generation_tokens", "_total") - _sample(
        before, "raylm_generation_tokens", "_total") == response.usage.completion_tokens
    for histogram in ("raylm_time_to_first_token_seconds", "raylm_time_per_output_token_seconds",
                      "raylm_e2e_request_latency_seconds", "raylm_engine_time_to_first_token_seconds"):
        assert after[histogram].type == "histogram"
        assert _sample(after, histogram, "_count") == _sample(before, histogram, "_count") + 1
    added = {histogram: _sample(after, histogram, "_sum") - _sample(before, histogram, "_sum")
             for histogram in ("raylm_time_to_first_token_seconds", "raylm_engine_time_to_first_token_seconds")}
    # The engine's own TTFT lies within the server's, which also holds the submission and the output's way back.
    assert 0 < added["raylm_engine_time_to_first_token_seconds"] <= added["raylm_time_to_first_token_seconds"]
    for gauge in ("raylm_num_requests_running", "raylm_num_requests_waiting", "raylm_num_requests_in_flight"):
        assert after[gauge].type == "gauge" and _sample(after, gauge) == 0
    assert 0 <= _sample(after, "raylm_kv_cache_usage_ratio") <= 1
    assert 0 <= _sample(after, "raylm_prefix_cache_hit_rate") <= 1
    assert _sample(after, "raylm_request_success", "_total") >= 1


def test_tokenize_and_detokenize_round_trip(base_url, llm):
    tokens = _post(base_url, "/tokenize", {"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens == {"tokens": llm.tokenizer.encode("Hello world"), "count": 2, "max_model_len": 1024}
    chat = _post(base_url, "/tokenize", {"messages": CHAT["messages"]}).json()
    assert chat["tokens"] == llm.tokenizer.apply_chat_template(CHAT["messages"], add_generation_prompt=True,
                                                               tokenize=True, return_dict=False)
    assert _post(base_url, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert _error(_post(base_url, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens"
    _error(_post(base_url, "/tokenize", {"model": "other", "prompt": "x"}), 404)
    _error(_post(base_url, "/tokenize", {}), 400)
