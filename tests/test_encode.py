"""LLM.encode on encode_only engines: all-MiniLM-L6-v2's embeddings equal sentence-transformers', batched and
single; a decoder's last-token embeddings equal HF transformers' hidden states; the errors of encoding and of
generating on the wrong kind of engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from raylm import LLM, AsyncLLM, EncoderOutput, PoolingConfig
from tests.conftest import SENTENCES


@pytest.fixture(scope="module")
def minilm_llm(minilm_dir):
    with LLM(str(minilm_dir), max_batch_size=4) as llm:
        yield llm


def _assert_matches(embeddings: torch.Tensor, reference) -> None:
    reference = torch.as_tensor(reference)
    assert embeddings.shape == reference.shape
    torch.testing.assert_close(embeddings, reference, atol=1e-5, rtol=0)
    assert F.cosine_similarity(embeddings, reference).min() >= 0.99999


def test_a_batch_equals_sentence_transformers(minilm_llm, sentence_transformer):
    outputs = minilm_llm.encode(SENTENCES)  # more prompts than max_batch_size: several engine steps
    assert [output.prompt for output in outputs] == SENTENCES
    assert all(isinstance(output, EncoderOutput) for output in outputs)
    _assert_matches(torch.stack([output.embedding for output in outputs]), sentence_transformer.encode(SENTENCES))


def test_a_single_prompt_and_token_ids_equal_sentence_transformers(minilm_llm, sentence_transformer):
    output = minilm_llm.encode(SENTENCES[1])
    _assert_matches(output.embedding[None], sentence_transformer.encode(SENTENCES[1:2]))
    token_ids = minilm_llm.tokenizer.encode(SENTENCES[3])
    by_ids = minilm_llm.encode(token_ids)
    assert by_ids.prompt_token_ids == token_ids and by_ids.prompt is None
    _assert_matches(by_ids.embedding[None], sentence_transformer.encode(SENTENCES[3:4]))


def test_raw_logits_are_every_embedding_in_one_tensor(minilm_llm):
    raw = minilm_llm.encode(SENTENCES[:3], return_raw_logits=True)
    assert raw.shape == (3, 384) and raw.device.type == "cpu"
    torch.testing.assert_close(raw.norm(dim=-1), torch.ones(3))


def test_concurrent_requests_batch_together_and_each_gets_its_own_embedding(minilm_llm, sentence_transformer):
    async def encode_all():
        return await asyncio.gather(*(minilm_llm.encode_async(text) for text in SENTENCES))

    outputs = asyncio.run(encode_all())
    _assert_matches(torch.stack([output.embedding for output in outputs]), sentence_transformer.encode(SENTENCES))


def test_encoding_errors_are_value_errors_naming_the_limit(minilm_llm):
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens, more than max_seq_len \(256\)"):
        minilm_llm.encode("word " * 300)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 30522\)"):
        minilm_llm.encode([101, 30522, 102])
    with pytest.raises(ValueError, match="prompt must not be empty"):
        minilm_llm.encode("")
    with pytest.raises(TypeError, match="encode_async takes a single prompt"):
        minilm_llm.encode_async(["a", "b"])


def test_an_encode_only_engine_cannot_generate(minilm_llm):
    with pytest.raises(ValueError, match="runs encode_only: it encodes prompts into embeddings"):
        minilm_llm.generate("Hello")
    with pytest.raises(RuntimeError, match="no KV cache"):
        minilm_llm.get_kv_cache_capacity()


def test_a_prompt_beyond_max_num_tokens_is_refused(minilm_dir):
    with LLM(str(minilm_dir), max_num_tokens=8) as llm:
        with pytest.raises(ValueError, match=r"more than max_num_tokens \(8\): an encoded prompt runs whole"):
            llm.encode(SENTENCES[1])


def test_bad_engine_settings_are_errors(minilm_dir, tiny_model_dirs):
    with pytest.raises(ValueError, match="encode_only must be true or unset for BertModel"):
        LLM(str(minilm_dir), encode_only=False)
    with pytest.raises(ValueError, match="pooling_config needs an encode_only engine"):
        LLM(str(tiny_model_dirs["llama"]), pooling_config=PoolingConfig(pooling_type="mean"))


def test_encode_on_a_generating_engine_says_how_to_start_one_that_encodes(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), max_seq_len=64, kv_cache_config={"max_tokens": 256}) as llm:
        with pytest.raises(RuntimeError, match=r"encode needs an encode_only engine.*encode_only=True"):
            llm.encode([1, 2, 3])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_decoder_pools_its_last_token_as_hf_hidden_states_say(tiny_model_dirs, arch):
    from transformers import AutoModel

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(100, 160)), [42]]
    with LLM(str(tiny_model_dirs[arch]), encode_only=True, max_seq_len=128) as llm:
        assert llm.info.pooling.pooling_type == "last" and llm.info.pooling.normalize
        outputs = llm.encode(prompts)
    reference = AutoModel.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.stack([F.normalize(reference(torch.tensor([prompt])).last_hidden_state[0, -1], dim=-1)
                                for prompt in prompts])
    _assert_matches(torch.stack([output.embedding for output in outputs]), expected)


def test_pooling_config_sets_what_the_model_does_not(tiny_model_dirs):
    from transformers import AutoModel

    prompt = [3, 4, 5, 6]
    with LLM(str(tiny_model_dirs["qwen2"]), encode_only=True, max_seq_len=64,
             pooling_config=PoolingConfig(pooling_type="mean", normalize=False)) as llm:
        embedding = llm.encode(prompt).embedding
    reference = AutoModel.from_pretrained(tiny_model_dirs["qwen2"], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).last_hidden_state[0].mean(0)
    torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=0)


def test_async_llm_encodes_once_set_up(minilm_dir, sentence_transformer):
    async def run():
        async with AsyncLLM(model=str(minilm_dir), executor="local") as llm:
            return llm.encode(SENTENCES[:2]), await llm.encode_async(SENTENCES[2])

    batch, single = asyncio.run(run())
    _assert_matches(torch.stack([output.embedding for output in [*batch, single]]),
                    sentence_transformer.encode(SENTENCES[:3]))
