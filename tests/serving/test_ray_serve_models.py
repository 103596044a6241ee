"""Two models in one Ray Serve app (ServeArgs.models): two tiny models of different architectures, each its own
engine deployment with its own settings, behind one ingress, through the official openai client."""

from __future__ import annotations

import httpx2
import openai
import pytest

from raylm import LLM, SamplingParams
from raylm.serving.config import ServeArgs
from raylm.serving.ray_serve import build_openai_app
from tests.serving.conftest import free_port, openai_client, ray_served

# A Ray cluster, Serve and two engine deployments take well over 30 s to start on the CI machine, so the tests of
# the running app are slow ones; the routing itself is tested in process (test_model_router.py).
slow = pytest.mark.slow

PROMPT = "The capital of France is"
# A prompt of about 300 tokens: longer than qwen's max_seq_len, shorter than llama's.
LONG_PROMPT = "hello " * 300


@pytest.fixture(scope="module")
def config(tiny_model_dirs) -> ServeArgs:
    return ServeArgs.model_validate({
        "host": "127.0.0.1", "port": free_port(), "max_batch_size": 4, "kv_cache_config": {"max_tokens": 2048},
        "models": [
            {"model": str(tiny_model_dirs["llama"]), "served_model_name": "llama", "max_seq_len": 512},
            {"model": str(tiny_model_dirs["qwen2"]), "served_model_name": "qwen", "max_seq_len": 256,
             "max_batch_size": 2},
        ],
    })


@pytest.fixture(scope="module")
def base_url(config):
    with ray_served(config, num_cpus=8) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai_client(base_url)


@slow
def test_each_model_answers_under_its_name_from_its_own_engine(client, config):
    greedy = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    texts = {name: client.completions.create(model=name, **greedy) for name in ("llama", "qwen")}
    assert {name: completion.model for name, completion in texts.items()} == {"llama": "llama", "qwen": "qwen"}
    qwen = config.served_models()[1]
    with LLM(**{**qwen.llm_kwargs(), "executor": "local"}) as llm:
        expected = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert texts["qwen"].choices[0].text == expected.outputs[0].text
    assert texts["llama"].choices[0].text != texts["qwen"].choices[0].text
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.model == "llama" and chat.usage.completion_tokens <= 3


@slow
def test_each_engine_runs_its_own_settings(client):
    assert {card.id: card.model_extra["max_model_len"] for card in client.models.list().data} == {
        "llama": 512, "qwen": 256}
    assert client.completions.create(model="llama", prompt=LONG_PROMPT, max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="qwen", prompt=LONG_PROMPT, max_tokens=1)
    assert info.value.body["param"] == "prompt" and "max_seq_len is 256" in info.value.body["message"]


@slow
def test_an_unknown_model_is_a_404_and_health_covers_both(client, base_url):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and "`llama`, `qwen`" in info.value.body["message"]
    assert httpx2.get(f"{base_url}/health", timeout=60).status_code == 200
    info = httpx2.get(f"{base_url}/server_info", timeout=60).json()
    assert {model["model"]: model["kv_cache"]["maxNumTokens"] for model in info["models"]} == {
        "llama": 2048, "qwen": 2048}


@slow
def test_each_model_is_an_engine_deployment_of_its_own():
    from ray import serve

    deployments = serve.status().applications["raylm"].deployments
    assert set(deployments) == {"OpenAIIngress", "RaylmEngine-0-llama", "RaylmEngine-1-qwen"}


def test_a_model_on_the_local_executor_is_refused_naming_it():
    config = ServeArgs(models=[{"model": "a", "served_model_name": "a"},
                               {"model": "b", "served_model_name": "b", "executor": "local"}])
    with pytest.raises(ValueError, match="got 'local' \\(model 'b'\\)"):
        build_openai_app(config)
