"""Beam search against HF transformers' num_beams search on tiny models."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, KvCacheConfig, SamplingParams
from tests.conftest import hf_model

WIDTH = 4
NEW_TOKENS = 12
PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040], [2]]


def _hf_beams(model, prompt: list[int], eos_ids: list[int], length_penalty: float = 1.0) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, num_beams=WIDTH,
                             num_return_sequences=WIDTH, do_sample=False, early_stopping=False,
                             length_penalty=length_penalty, eos_token_id=eos_ids, pad_token_id=-1)
    beams = []
    for row in out[:, len(prompt):].tolist():
        beams.append([token for token in row if token != -1])
    return beams


def _our_beams(llm: LLM, prompt: list[int], stop_ids: list[int], length_penalty: float = 1.0) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, n=WIDTH, use_beam_search=True, stop_token_ids=stop_ids,
                            length_penalty=length_penalty)
    return [completion.token_ids for completion in llm.generate(prompt, params).outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_beam_search_equals_hf_num_beams_4(arch, tiny_model_dirs):
    path = tiny_model_dirs[arch]
    hf = hf_model(path)
    with LLM(str(path), kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=4)) as llm:
        for prompt in PROMPTS:
            assert _our_beams(llm, prompt, []) == _hf_beams(hf, prompt, [2])


def test_beam_search_with_frequent_stop_token_equals_hf(tiny_model_dirs):
    """A stop token that beams actually emit exercises finished hypotheses and the early-stop rule."""
    path = tiny_model_dirs["llama"]
    hf = hf_model(path)
    with LLM(str(path), kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=4)) as llm:
        prompt = PROMPTS[0]
        free_run = _our_beams(llm, prompt, [])
        stop = free_run[0][4]  # a token the best beam produces a few steps in
        assert any(beam[-1] == stop for beam in _our_beams(llm, prompt, [stop]))
        for length_penalty in (1.0, 0.0, 2.0):
            assert _our_beams(llm, prompt, [stop], length_penalty) == _hf_beams(hf, prompt, [2, stop], length_penalty)


def test_beam_search_frees_every_block_when_done(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=4)) as llm:
        _our_beams(llm, PROMPTS[1], [])
        stats = llm.get_stats(timeout=0)
    assert stats[-1]["kvCacheStats"]["usedNumBlocks"] == 0
    assert max(s["kvCacheStats"]["usedNumBlocks"] for s in stats) > 0
