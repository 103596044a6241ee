"""Greedy tokens and log-probabilities against HF transformers (fp32, CPU)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from raylm import LLM, KvCacheConfig, SamplingParams, TokensPrompt
from tests.conftest import PROMPTS, TINY_ARCHS, hf_greedy, hf_model, logprob_errors

NEW_TOKENS = 32
TOLERANCE = 1e-4


def _prompt_ids(path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


def _generate(path, prompts: list[list[int]], **llm_kwargs):
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0)
    with LLM(str(path), **llm_kwargs) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        stats = llm.get_stats(timeout=0)
    return outputs, stats


def assert_matches_hf(hf, prompts, outputs) -> None:
    for prompt_ids, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        expected = hf_greedy(hf, prompt_ids, NEW_TOKENS)
        assert completion.token_ids == expected, f"prompt {prompt_ids[:8]}..."
        assert output.prompt_logprobs[0] is None
        generated, prompt_errors = logprob_errors(hf, prompt_ids, output)
        assert len(prompt_errors) == len(prompt_ids) - 1
        assert all(error < TOLERANCE for error in generated + prompt_errors)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_greedy_tokens_and_logprobs_equal_hf(arch, tiny_model_dirs):
    path = tiny_model_dirs[arch]
    prompts = _prompt_ids(path)
    outputs, _ = _generate(path, prompts, kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=16))
    assert_matches_hf(hf_model(path), prompts, outputs)


@pytest.mark.parametrize(
    "setting",
    ["prefix_cache_off", "chunked_prefill_16", "preemption"],
)
def test_tiny_llama_same_tokens_under_engine_settings(setting, tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    prompts = _prompt_ids(path)
    kwargs = {
        "prefix_cache_off": dict(kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=16,
                                                               enable_block_reuse=False)),
        "chunked_prefill_16": dict(max_num_tokens=16, kv_cache_config=KvCacheConfig(max_tokens=4096,
                                                                                    tokens_per_block=16)),
        "preemption": dict(kv_cache_config=KvCacheConfig(max_tokens=160, tokens_per_block=16)),
    }[setting]
    outputs, stats = _generate(path, prompts, **kwargs)
    assert_matches_hf(hf_model(path), prompts, outputs)
    if setting == "preemption":
        assert sum(s["inflightBatchingStats"]["numPausedRequests"] for s in stats) > 0
    if setting == "chunked_prefill_16":
        assert max(s["inflightBatchingStats"]["numCtxTokens"] for s in stats) <= 16


def test_shared_prefixes_hit_the_prefix_cache_and_keep_tokens(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    system = "You are a careful assistant. Answer briefly and precisely. " * 4
    prompts = [tokenizer.encode(system + question) for question in ["Why is the sky blue?", "What is 7 * 6?"]]
    with LLM(str(path), kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=16)) as llm:
        first = llm.generate(TokensPrompt(prompt_token_ids=prompts[0]), SamplingParams(max_tokens=8))
        second = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                              SamplingParams(max_tokens=8), use_tqdm=False)
        stats = llm.get_stats(timeout=0)
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert second[0].num_cached_tokens >= 16 * (len(prompts[0]) // 16 - 1)
    assert second[1].num_cached_tokens >= 32
    assert stats[-1]["kvCacheStats"]["reusedBlocks"] > 0
    hf = hf_model(path)
    for ids, output in zip(prompts, second):
        assert output.outputs[0].token_ids == hf_greedy(hf, ids, 8)


def test_smollm2_batch_matches_hf_with_chunked_prefill_and_paging(smollm2_dir):
    prompts = _prompt_ids(smollm2_dir)
    outputs, stats = _generate(smollm2_dir, prompts, max_num_tokens=64,
                               kv_cache_config=KvCacheConfig(max_tokens=8192, tokens_per_block=16))
    assert max(s["numActiveRequests"] for s in stats) >= 10
    assert_matches_hf(hf_model(smollm2_dir), prompts, outputs)
