"""POST /v1/embeddings through the real openai client against an all-MiniLM-L6-v2 server: embeddings equal
sentence-transformers', as floats and as base64, for every shape of input; usage; dimensions where the model
allows it and a 400 naming it where not; OpenAI error bodies for bad input; the 400s between embedding and
generation servers. And RemoteEngine.embed, the same call across Ray Serve, over a stand-in handle."""

from __future__ import annotations

import asyncio
import base64
import re

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from raylm import LLM, EncoderOutput, PoolingConfig
from raylm.engine_client import EngineDeadError
from raylm.engine_spec import EngineInfo
from raylm.pooling import PoolingSpec
from raylm.serving import LocalEngine, ServingConfig, build_app
from raylm.serving.remote_engine import EngineDescription, RemoteEngine
from tests.conftest import SENTENCES
from tests.serving.conftest import openai_client, serve

MODEL = "minilm-test"


@pytest.fixture(scope="module")
def embedding_client(minilm_dir):
    with LLM(str(minilm_dir)) as llm, serve(build_app(LocalEngine(llm), ServingConfig(served_model_name=MODEL))) as url:
        yield openai_client(url)


def _as_tensor(response) -> torch.Tensor:
    """The response's embeddings; a base64 one decoded as OpenAI documents it (little-endian float32 bytes). The
    client decodes them itself only when it chose base64, the encoding_format it sends by default."""
    assert [item.index for item in response.data] == list(range(len(response.data)))
    rows = [np.frombuffer(base64.b64decode(item.embedding), dtype="<f4") if isinstance(item.embedding, str)
            else np.asarray(item.embedding, dtype=np.float32) for item in response.data]
    return torch.tensor(np.stack(rows))


def _assert_matches(embeddings: torch.Tensor, reference) -> None:
    reference = torch.as_tensor(reference)
    torch.testing.assert_close(embeddings, reference, atol=1e-5, rtol=0)
    assert F.cosine_similarity(embeddings, reference).min() >= 0.99999


@pytest.mark.parametrize("encoding_format", ["float", "base64", openai.NOT_GIVEN])  # the client's default: base64
def test_a_batch_of_texts_equals_sentence_transformers(embedding_client, sentence_transformer, encoding_format):
    response = embedding_client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format=encoding_format)
    assert response.model == MODEL and response.object == "list"
    _assert_matches(_as_tensor(response), sentence_transformer.encode(SENTENCES))
    tokens = sum(len(sentence_transformer.tokenizer.encode(text)) for text in SENTENCES)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_base64_is_the_float32_bytes_of_the_floats(embedding_client):
    encoded = embedding_client.embeddings.create(model=MODEL, input="hi", encoding_format="base64").data[0].embedding
    floats = embedding_client.embeddings.create(model=MODEL, input="hi", encoding_format="float").data[0].embedding
    assert isinstance(encoded, str) and isinstance(floats, list) and len(floats) == 384
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == pytest.approx(floats, abs=1e-7)


def test_a_single_text_and_token_id_inputs_equal_sentence_transformers(embedding_client, sentence_transformer):
    reference = sentence_transformer.encode(SENTENCES[:2])
    single = embedding_client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float")
    _assert_matches(_as_tensor(single), reference[:1])
    ids = [sentence_transformer.tokenizer.encode(text) for text in SENTENCES[:2]]
    one = embedding_client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    _assert_matches(_as_tensor(one), reference[:1])
    assert one.usage.prompt_tokens == len(ids[0])
    both = embedding_client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    _assert_matches(_as_tensor(both), reference)


def test_concurrent_requests_each_get_their_own_embeddings(embedding_client, sentence_transformer):
    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=str(embedding_client.base_url), api_key="unused", max_retries=0)
        responses = await asyncio.gather(*(client.embeddings.create(model=MODEL, input=text, encoding_format="float")
                                           for text in SENTENCES))
        await client.close()
        return responses

    responses = asyncio.run(all_at_once())
    _assert_matches(torch.cat([_as_tensor(response) for response in responses]), sentence_transformer.encode(SENTENCES))


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    return info.value.status_code, info.value.body


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    (dict(input=[]), "input", "input must not be empty"),
    (dict(input=["ok", ""]), "input", "input must not be empty"),
    (dict(input=[[1, 2], []]), "input", "input must not be empty"),
    (dict(input="word " * 300), "input", r"prompt has \d+ tokens, more than max_seq_len \(256\)"),
    (dict(input=[101, 40000, 102]), "input", r"prompt token ids must be in \[0, 30522\)"),
    (dict(input="hi", dimensions=64), "dimensions", "dimensions is not supported by this model"),
    (dict(input="hi", dimensions=0), "dimensions", "greater than or equal to 1"),
    (dict(input="hi", encoding_format="int8"), "encoding_format", "float"),
    (dict(input={"text": "hi"}), "input", "input must be a string, a list of strings"),
])
def test_bad_input_is_a_400_in_openai_shape_naming_the_field(embedding_client, kwargs, param, message):
    status, body = _error(lambda: embedding_client.embeddings.create(model=MODEL, **kwargs))
    assert status == 400
    assert body["type"] == "invalid_request_error" and body["param"] == param
    assert re.search(message, body["message"]), body["message"]


def test_an_unknown_model_is_a_404(embedding_client):
    status, body = _error(lambda: embedding_client.embeddings.create(model="other", input="hi"))
    assert status == 404 and body["code"] == "model_not_found"


def test_an_embedding_server_answers_generation_with_a_400(embedding_client):
    for call in (lambda: embedding_client.completions.create(model=MODEL, prompt="Hi", max_tokens=2),
                 lambda: embedding_client.chat.completions.create(model=MODEL,
                                                                  messages=[{"role": "user", "content": "Hi"}])):
        status, body = _error(call)
        assert status == 400 and body["code"] == "model_not_supported"
        assert "embedding model (encode_only)" in body["message"]


def test_a_generation_server_answers_embeddings_with_a_400(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), max_seq_len=64, kv_cache_config={"max_tokens": 256}) as llm, \
            serve(build_app(LocalEngine(llm), ServingConfig(served_model_name="gen"))) as url:
        status, body = _error(lambda: openai_client(url).embeddings.create(model="gen", input=[1, 2, 3]))
    assert status == 400 and body["code"] == "model_not_supported" and body["param"] == "model"
    assert "encode_only=true" in body["message"]


def test_dimensions_truncate_and_renormalize_where_the_model_allows(minilm_dir, sentence_transformer):
    config = PoolingConfig(matryoshka_dimensions=[128, 256])
    with LLM(str(minilm_dir), pooling_config=config) as llm, \
            serve(build_app(LocalEngine(llm), ServingConfig(served_model_name=MODEL))) as url:
        client = openai_client(url)
        response = client.embeddings.create(model=MODEL, input=SENTENCES[:3], dimensions=128, encoding_format="float")
        status, body = _error(lambda: client.embeddings.create(model=MODEL, input="hi", dimensions=100))
    expected = F.normalize(torch.as_tensor(sentence_transformer.encode(SENTENCES[:3]))[:, :128], dim=-1)
    _assert_matches(_as_tensor(response), expected)
    assert status == 400 and body["param"] == "dimensions" and "one of [128, 256], got 100" in body["message"]


# ---------------------------------------------------------------------------------------------- RemoteEngine


class FakeEmbedCall:
    def __init__(self, answer):
        self.answer = answer
        self.prompts = None

    async def remote(self, prompts):
        self.prompts = prompts
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class FakeHandle:
    def __init__(self, answer):
        self.embed = FakeEmbedCall(answer)

    def options(self, **kwargs):
        return self


def _remote(answer) -> RemoteEngine:
    info = EngineInfo(num_blocks=0, block_size=32, max_seq_len=256, vocab_size=10, device="cpu", dtype="float32",
                      pooling=PoolingSpec("mean", True, 4))
    return RemoteEngine(FakeHandle(answer), tokenizer=None, description=EngineDescription(info, {}, {}))


def test_remote_embed_returns_the_deployments_outputs_and_raises_its_errors_as_the_engine_did():
    from ray.exceptions import ActorDiedError, RayTaskError

    outputs = [EncoderOutput("1", None, [1, 2], torch.ones(4))]
    engine = _remote(outputs)
    assert asyncio.run(engine.embed([{"prompt_token_ids": [1, 2]}])) == outputs
    assert engine._handle.embed.prompts == [{"prompt_token_ids": [1, 2]}]
    error = ValueError("prompt has 300 tokens, more than max_seq_len (256)")
    wrapped = RayTaskError("embed", "Traceback (most recent call last): ...", error).as_instanceof_cause()
    with pytest.raises(ValueError) as info:
        asyncio.run(_remote(wrapped).embed([{"prompt_token_ids": [1]}]))
    assert info.value is error
    down = _remote(ActorDiedError())
    with pytest.raises(EngineDeadError, match="the engine deployment failed"):
        asyncio.run(down.embed([{"prompt_token_ids": [1]}]))
    assert down.dead_reason.startswith("the engine deployment failed")
