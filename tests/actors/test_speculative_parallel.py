"""Speculative decoding across ranks on CPU (gloo): the verify steps' chunks and their draws at every position go
through the multi-rank runner (TP=2) and the pipeline (PP=2, whose overlap holds speculating requests back),
and the draft model runs on the first rank alone; greedy tokens equal one rank's without speculation."""

from __future__ import annotations

import pytest

from raylm import LLM, DraftTargetDecodingConfig, KvCacheConfig, NGramDecodingConfig, SamplingParams, TokensPrompt

# Prompts that repeat themselves, so prompt lookup proposes (and the chain of a random model sometimes accepts).
PROMPTS = [[504, 3575, 282, 4649, 314] * 4, [19556, 28, 957, 1462, 314, 1133, 2040] * 3, [7, 8, 9]]


def _generate(model, **options) -> list[list[int]]:
    with LLM(str(model), skip_tokenizer_init=True, kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=16),
             max_seq_len=256, **options) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS],
                               SamplingParams(max_tokens=24), use_tqdm=False)
        stats = llm.get_stats(timeout=2)
    if "speculative_config" in options:
        assert stats[-1]["specDecodingStats"]["totalDraftTokens"] > 0
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize(("tp", "pp", "proposer"), [
    (2, 1, "ngram"),
    pytest.param(1, 2, "ngram", marks=pytest.mark.slow),  # ~19 s each on the CI machine
    pytest.param(2, 1, "draft_model", marks=pytest.mark.slow),
])
def test_speculation_across_ranks_gives_one_rank_s_tokens(ray_cluster, tiny_model_dirs, tp, pp, proposer):
    model = tiny_model_dirs["llama"]
    config = (NGramDecodingConfig(max_draft_len=4) if proposer == "ngram"
              else DraftTargetDecodingConfig(max_draft_len=3, speculative_model=str(model)))
    expected = _generate(model)
    assert _generate(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, speculative_config=config) == expected
