"""LoRA adapters served as models of their own: lora_modules, /v1/models, `model` routing to the adapter, and
/v1/load_lora_adapter / /v1/unload_lora_adapter at run time."""

from __future__ import annotations

import httpx2 as httpx
import pytest

from raylm import LLM, LoraConfig, LoRARequest, SamplingParams, TokensPrompt
from raylm.serving import LocalEngine, ServingConfig, build_app
from raylm.serving.config import ServeArgs
from tests.serving.conftest import openai_client, serve

PROMPT = [1, 450, 7483, 310, 3444, 338]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dirs, tiny_lora_dirs):
    """(base URL, llm, adapter dirs): the tiny Llama served as `base` with adapter `first` from lora_modules."""
    names = sorted(tiny_lora_dirs)
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", skip_tokenizer_init=False,
              lora_config=LoraConfig(max_loras=2, max_lora_rank=64))
    config = ServingConfig(served_model_name="base", lora_modules=[f"first={tiny_lora_dirs[names[0]]}"],
                           enable_lora_loading=True)
    with serve(build_app(LocalEngine(llm), config)) as url:
        yield url, llm, [tiny_lora_dirs[name] for name in names]
    llm.shutdown()


def _tokens(llm: LLM, lora: LoRARequest | None) -> list[int]:
    output = llm.generate(TokensPrompt(prompt_token_ids=PROMPT), SamplingParams(max_tokens=8, temperature=0),
                          lora_request=lora)
    return output.outputs[0].token_ids


def _pieces(llm: LLM, token_ids: list[int]) -> list[str]:
    """Each token's text, as a completion's logprobs report it."""
    return [llm.tokenizer.decode([token]) for token in token_ids]


def _served_tokens(url: str, model: str) -> list[str]:
    response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0, "logprobs": 0}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_an_adapter_of_lora_modules_is_a_model_whose_requests_run_with_it(lora_server):
    url, llm, adapters = lora_server
    listed = {card.id: card for card in openai_client(url).models.list().data}
    assert set(listed) == {"base", "first"}
    assert listed["first"].parent == "base" and listed["first"].root == str(adapters[0])
    with_adapter = _tokens(llm, LoRARequest("first", 1, str(adapters[0])))
    assert with_adapter != _tokens(llm, None)  # the adapter changes the answer
    assert _served_tokens(url, "first") == _pieces(llm, with_adapter)
    assert _served_tokens(url, "base") == _pieces(llm, _tokens(llm, None))
    assert httpx.get(f"{url}/v1/models/first").json()["parent"] == "base"


def test_adapters_load_and_unload_at_run_time(lora_server):
    url, llm, adapters = lora_server
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(adapters[1])})
    assert loaded.status_code == 200 and loaded.json()["parent"] == "base"
    assert "second" in {card.id for card in openai_client(url).models.list().data}
    expected = _pieces(llm, _tokens(llm, LoRARequest("x", 99, str(adapters[1]))))
    assert _served_tokens(url, "second") == expected
    taken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(adapters[0])})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": "/nonexistent"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
    gone = httpx.post(f"{url}/v1/completions", json={"model": "second", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 404


def test_lora_modules_are_name_path_pairs_and_turn_lora_config_on():
    args = ServeArgs(model="m", lora_modules=["a=/x", "b=/y"])
    assert args.lora_config == LoraConfig() and args.serving_config().lora_adapters == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="lora_modules entries are 'name=path'"):
        ServeArgs(model="m", lora_modules=["a"])
    with pytest.raises(ValueError, match="names each adapter once"):
        ServeArgs(model="m", lora_modules=["a=/x", "a=/y"])
