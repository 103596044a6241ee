"""One server of several models (build_models_app, model_router.py), in this process over three engines: two tiny
generating models of different architectures and settings, and an embedding model. Each request goes to the engine
its `model` names (its answer is that engine's own), /v1/models lists them all, an unknown model is OpenAI's 404,
a request that names no model is a 400 where the field is optional, and health and metrics cover every model."""

from __future__ import annotations

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raylm import LLM, KvCacheConfig, SamplingParams
from raylm.serving import LocalEngine, ServingConfig
from raylm.serving.app import build_models_app
from tests.serving.conftest import openai_client, serve

# name: (tiny architecture, max_seq_len)
GENERATORS = {"llama": ("llama", 512), "qwen": ("qwen2", 256)}
EMBEDDER = "minilm"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, minilm_dir):
    llms = {name: LLM(str(tiny_model_dirs[arch]), max_seq_len=max_seq_len, max_batch_size=4,
                      kv_cache_config=KvCacheConfig(max_tokens=2048))
            for name, (arch, max_seq_len) in GENERATORS.items()}
    llms[EMBEDDER] = LLM(str(minilm_dir))
    yield llms
    for llm in llms.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def base_url(engines):
    app = build_models_app([(LocalEngine(llm), ServingConfig(served_model_name=name)) for name, llm in engines.items()])
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai_client(base_url)


def _greedy(llm: LLM, max_tokens: int = 8) -> str:
    return llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)).outputs[0].text


def test_each_model_answers_under_its_name_with_its_own_engine(client, engines):
    texts = {}
    for name in GENERATORS:
        completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert completion.model == name
        texts[name] = completion.choices[0].text
        assert texts[name] == _greedy(engines[name])
    assert texts["llama"] != texts["qwen"]  # so a request sent to the wrong engine would fail the test
    streamed = client.completions.create(model="qwen", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == texts["qwen"]
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0)
    assert chat.model == "llama" and chat.usage.completion_tokens <= 3
    response = client.responses.create(model="qwen", input="Hi", max_output_tokens=3, temperature=0)
    assert response.model == "qwen" and response.usage.output_tokens <= 3


def test_embeddings_go_to_the_embedding_model_and_generation_to_the_others(client, base_url):
    embedding = client.embeddings.create(model=EMBEDDER, input=["a sentence"]).data[0].embedding
    assert len(embedding) == 384
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="llama", input=["a sentence"])
    assert info.value.body["code"] == "model_not_supported"
    response = httpx2.post(f"{base_url}/v1/completions", json={"model": EMBEDDER, "prompt": "x"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_supported"


def test_models_lists_every_model_with_its_own_context_length(client):
    cards = client.models.list().data
    assert [card.id for card in cards] == [*GENERATORS, EMBEDDER]
    lengths = {card.id: card.model_extra["max_model_len"] for card in cards}
    assert {name: lengths[name] for name in GENERATORS} == {name: length for name, (_, length) in GENERATORS.items()}
    assert client.models.retrieve("qwen").model_extra["max_model_len"] == 256


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
                                   "/tokenize", "/detokenize"])
def test_an_unknown_model_is_a_404_naming_the_served_ones(base_url, route):
    body = {"model": "gpt-4o", "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "input": "Hi",
            "tokens": [1]}
    fields = {"/v1/completions": ("model", "prompt"), "/v1/chat/completions": ("model", "messages"),
              "/v1/responses": ("model", "input"), "/v1/embeddings": ("model", "input"),
              "/tokenize": ("model", "prompt"), "/detokenize": ("model", "tokens")}[route]
    response = httpx2.post(f"{base_url}{route}", json={field: body[field] for field in fields}, timeout=60)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert error["message"] == "The model `gpt-4o` does not exist; this server serves `llama`, `qwen`, `minilm`"
    assert httpx2.get(f"{base_url}/v1/models/gpt-4o", timeout=60).status_code == 404


def test_a_request_naming_no_model_is_a_400_on_a_server_of_several(base_url):
    for route, body in [("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]}),
                        ("/v1/completions", {"prompt": "Hi"})]:
        response = httpx2.post(f"{base_url}{route}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == ("model", "missing_required_parameter")
    assert httpx2.get(f"{base_url}/tokenizer_info", timeout=60).status_code == 400
    tokenized = httpx2.post(f"{base_url}/tokenize", json={"model": "qwen", "prompt": "Hi"}, timeout=60).json()
    assert tokenized["max_model_len"] == 256
    info = httpx2.get(f"{base_url}/tokenizer_info", params={"model": "llama"}, timeout=60).json()
    assert info["max_seq_len"] == 512


def test_health_server_info_and_metrics_cover_every_model(client, base_url):
    for name in GENERATORS:
        client.completions.create(model=name, prompt="Hello", max_tokens=2)
    assert httpx2.get(f"{base_url}/health", timeout=60).json() == {"status": "ok"}
    info = httpx2.get(f"{base_url}/server_info", timeout=60).json()
    assert [model["model"] for model in info["models"]] == [*GENERATORS, EMBEDDER] and "model" not in info
    assert {stats["model"] for stats in httpx2.get(f"{base_url}/metrics", timeout=60).json()} >= set(GENERATORS)
    families = {family.name: family for family in text_string_to_metric_families(
        httpx2.get(f"{base_url}/prometheus/metrics", timeout=60).text)}
    generated = {sample.labels["model_name"]: sample.value for sample in families["raylm_generation_tokens"].samples
                 if sample.name.endswith("_total")}
    assert all(generated[name] >= 2 for name in GENERATORS)
    in_flight = families["raylm_num_requests_in_flight"].samples
    assert [sample.labels["model_name"] for sample in in_flight] == [""]  # the server's bound, not one model's


def test_server_settings_must_agree_and_the_rl_routes_need_one_model(engines):
    llama, qwen = LocalEngine(engines["llama"]), LocalEngine(engines["qwen"])
    with pytest.raises(ValueError, match="max_queue is a setting of the whole server"):
        build_models_app([(llama, ServingConfig(served_model_name="a")),
                          (qwen, ServingConfig(served_model_name="b", max_queue=3))])
    with pytest.raises(ValueError, match="'a' is given twice"):
        build_models_app([(llama, ServingConfig(served_model_name="a")), (qwen, ServingConfig(served_model_name="a"))])
    with pytest.raises(ValueError, match="enable_rl_endpoints drives one engine"):
        build_models_app([(llama, ServingConfig(served_model_name="a", enable_rl_endpoints=True)),
                          (qwen, ServingConfig(served_model_name="b", enable_rl_endpoints=True))])
