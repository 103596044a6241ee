"""Overlapped scheduling: step N+1 is queued before step N's draws are applied, and the outputs are exactly
those of the engine that waits for every step."""

from __future__ import annotations

import pytest

from raylm import LLM, KvCacheConfig, SamplingParams, TokensPrompt

PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040] * 5, [7, 7, 7],
           list(range(1000, 1040)), [2, 9, 77, 1203, 11, 8, 3, 40] * 3, [11, 12, 13, 14]]


def _llm(path, overlap: bool, **kwargs) -> LLM:
    kv = KvCacheConfig(max_tokens=2048, tokens_per_block=4, enable_block_reuse=True)
    return LLM(str(path), skip_tokenizer_init=True, kv_cache_config=kv, max_seq_len=256,
               disable_overlap_scheduler=not overlap, **kwargs)


def _mixed_params(eos: int) -> list[SamplingParams]:
    """A batch mixing what overlaps (greedy, seeded, logprobs, stop ids, min_tokens) with what must wait for
    its draws (penalties, n > 1, beam search), with lengths that end sequences at different steps."""
    return [
        SamplingParams(max_tokens=17, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.8, seed=3, n=2),
        SamplingParams(max_tokens=12, repetition_penalty=1.3, presence_penalty=0.4),
        SamplingParams(max_tokens=20, stop_token_ids=[eos], min_tokens=3, temperature=1.0, top_k=5, seed=11),
        SamplingParams(max_tokens=6, use_beam_search=True, best_of=3, n=2),
        SamplingParams(max_tokens=1),
    ]


def _summary(outputs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason, round(c.cumulative_logprob or 0.0, 4),
              [sorted((t, round(lp.logprob, 4)) for t, lp in step.items()) for step in (c.logprobs or [])])
             for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_overlap_gives_exactly_the_outputs_of_the_waiting_engine(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    results = {}
    for overlap in (True, False):
        with _llm(path, overlap) as llm:
            assert llm._executor.worker.engine.overlap == overlap
            eos = llm.info.vocab_size - 1
            prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
            first = llm.generate(prompts, _mixed_params(eos), use_tqdm=False)
            again = llm.generate(prompts, _mixed_params(eos), use_tqdm=False)  # from the prefix cache
            _assert_equal_but_for_rounding(_summary(first), _summary(again))
            results[overlap] = _summary(first)
    assert results[True] == results[False]


def _assert_equal_but_for_rounding(first, again, tolerance: float = 2e-4):
    """The same tokens, finish and stop reasons, and logprobs to within `tolerance`: a prompt read back from the
    prefix cache computes its suffix in other matmul shapes than its whole prefill did, so float32 rounds
    differently in the last bits (and a logprob rounded to 4 decimals can land either side of a boundary)."""
    assert len(first) == len(again)
    for outputs, outputs_again in zip(first, again):
        assert len(outputs) == len(outputs_again)
        for (tokens, finish, stop, cumulative, steps), (tokens2, finish2, stop2, cumulative2, steps2) in zip(
                outputs, outputs_again):
            assert (tokens, finish, stop) == (tokens2, finish2, stop2)
            assert cumulative == pytest.approx(cumulative2, abs=tolerance * max(1, len(tokens)))
            assert [[t for t, _ in step] for step in steps] == [[t for t, _ in step] for step in steps2]
            for step, step2 in zip(steps, steps2):
                assert [lp for _, lp in step] == pytest.approx([lp for _, lp in step2], abs=tolerance)


def test_a_sequence_stopping_while_the_next_step_is_queued_drops_its_extra_token(tiny_model_dirs):
    """Stop tokens end sequences at data-dependent steps: the token computed for them in the step queued
    meanwhile is never reported, and their blocks come back."""
    path = tiny_model_dirs["llama"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    with _llm(path, overlap=False) as llm:
        reference = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    # Stop at the 5th token each greedy sequence produces: a data-dependent stop inside the overlap window.
    stops = [o.outputs[0].token_ids[4] for o in reference]
    with _llm(path, overlap=True) as llm:
        outputs = [llm.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop]), use_tqdm=False)
                   for prompt, stop in zip(prompts, stops)]
        batched = llm.generate(prompts, [SamplingParams(max_tokens=40, stop_token_ids=[stop]) for stop in stops],
                               use_tqdm=False)
        engine = llm._executor.worker.engine
        assert engine.in_flight is None and not engine.scheduler.running
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    for ref, single, both, stop in zip(reference, outputs, batched, stops):
        expected = ref.outputs[0].token_ids[: ref.outputs[0].token_ids.index(stop) + 1]
        assert single.outputs[0].token_ids == expected == both.outputs[0].token_ids
        assert single.outputs[0].finish_reason == "stop" and single.outputs[0].stop_reason == stop


def test_the_next_step_is_queued_before_the_previous_one_is_collected(tiny_model_dirs):
    with _llm(tiny_model_dirs["llama"], overlap=True) as llm:
        runner = llm._executor.worker.runner
        events: list[str] = []
        launch, collect = runner.launch, runner.collect

        def record_launch(out, previous=None):
            events.append("launch")
            return launch(out, previous)

        def record_collect(launched):
            events.append("collect")
            return collect(launched)

        runner.launch, runner.collect = record_launch, record_collect
        llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]), SamplingParams(max_tokens=6, ignore_eos=True))
    # Six tokens: the prefill and five decodes, each launched before the previous step is collected.
    assert events[:4] == ["launch", "launch", "collect", "launch"]
    assert events.count("launch") == 6 and events.count("collect") == 6


def test_a_request_with_penalties_waits_for_its_draws(tiny_model_dirs):
    with _llm(tiny_model_dirs["llama"], overlap=True) as llm:
        runner = llm._executor.worker.runner
        events: list[str] = []
        launch, collect = runner.launch, runner.collect
        runner.launch = lambda out, previous=None: (events.append("launch"), launch(out, previous))[1]
        runner.collect = lambda launched: (events.append("collect"), collect(launched))[1]
        llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]),
                     SamplingParams(max_tokens=4, ignore_eos=True, frequency_penalty=0.5))
    assert events == ["launch", "collect"] * 4


def test_abort_while_a_step_is_in_flight_frees_everything(tiny_model_dirs):
    import asyncio

    async def run(llm):
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        results = [llm.generate_async(TokensPrompt(prompt_token_ids=p), params, streaming=True) for p in PROMPTS]
        for result in results[::2]:
            async for _ in result:
                break
            result.abort()
        return [await result for result in results[1::2]]

    with _llm(tiny_model_dirs["llama"], overlap=True) as llm:
        finished = asyncio.run(run(llm))
        assert all(len(o.outputs[0].token_ids) == 200 for o in finished)
        engine = llm._executor.worker.engine
        llm.generate(TokensPrompt(prompt_token_ids=[1, 2]), SamplingParams(max_tokens=1))
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_starting_an_engine_raises_the_collector_threshold_and_never_lowers_it(tiny_model_dirs):
    import gc

    from raylm.actors.engine_loop import GC_GEN0_THRESHOLD

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, before[1], before[2])
        with _llm(tiny_model_dirs["llama"], overlap=True):
            assert gc.get_threshold() == (GC_GEN0_THRESHOLD, before[1], before[2])
        gc.set_threshold(10 * GC_GEN0_THRESHOLD, before[1], before[2])
        with _llm(tiny_model_dirs["llama"], overlap=True):
            assert gc.get_threshold()[0] == 10 * GC_GEN0_THRESHOLD
    finally:
        gc.set_threshold(*before)
