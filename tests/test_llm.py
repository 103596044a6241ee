"""The offline LLM API: inputs, outputs, streaming, cancellation, n/best_of, stops, stats and bad input."""

from __future__ import annotations

import asyncio
import math

import pytest

from raylm import LLM, KvCacheConfig, RequestOutput, SamplingParams, TextPrompt, TokensPrompt


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=16, event_buffer_max_size=1000),
             max_seq_len=1024) as engine:
        yield engine


def _used_blocks(llm: LLM) -> int:
    """Blocks in use once the engine is idle: measured by the last iteration of a fresh one-step request."""
    llm.get_stats(timeout=0)
    llm.generate("x", SamplingParams(max_tokens=1))
    return llm.get_stats(timeout=1)[-1]["kvCacheStats"]["usedNumBlocks"]


# ---------------------------------------------------------------------- inputs and outputs


def test_every_prompt_form_gives_the_same_greedy_output(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=6)
    forms = ["The capital of France is", ids, TextPrompt(prompt="The capital of France is"),
             TokensPrompt(prompt_token_ids=ids)]
    outputs = [llm.generate(form, params) for form in forms]
    assert all(isinstance(output, RequestOutput) for output in outputs)
    assert len({tuple(output.outputs[0].token_ids) for output in outputs}) == 1
    assert outputs[0].outputs[0].text.startswith(" Paris")
    assert outputs[0].prompt == "The capital of France is" and outputs[0].prompt_token_ids == ids


def test_batch_returns_outputs_in_prompt_order_with_per_prompt_params(llm):
    prompts = ["One", "Two three", "Four five six"]
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in (1, 2, 3)], use_tqdm=False)
    assert [output.prompt for output in outputs] == prompts
    assert [len(output.outputs[0].token_ids) for output in outputs] == [1, 2, 3]
    assert all(output.finished and output.outputs[0].finish_reason == "length" for output in outputs)


def test_logprobs_report_top_k_with_ranks(llm):
    output = llm.generate("Hello", SamplingParams(max_tokens=4, logprobs=3)).outputs[0]
    assert len(output.logprobs) == 4
    for token, position in zip(output.token_ids, output.logprobs):
        assert position[token].rank == 1  # greedy picks the most likely token
        assert len(position) == 3
        ranks = sorted(entry.rank for entry in position.values())
        assert ranks == [1, 2, 3]
    assert output.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(output.token_ids,
                                                                                        output.logprobs)))


# ---------------------------------------------------------------------- async and streaming


def test_generate_async_awaits_the_final_output(llm):
    async def run():
        return await llm.generate_async("The capital of France is", SamplingParams(max_tokens=3))

    output = asyncio.run(run())
    assert output.finished and output.outputs[0].text.startswith(" Paris")


def test_streaming_deltas_concatenate_to_the_final_text(llm):
    async def run():
        chunks = []
        async for chunk in llm.generate_async("Write a haiku about the sea:", SamplingParams(max_tokens=24),
                                              streaming=True):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(run())
    assert len(chunks) > 3 and chunks[-1].finished and not chunks[0].finished
    final = chunks[-1].outputs[0]
    assert "".join(chunk.outputs[0].text_diff for chunk in chunks) == final.text
    assert sum((chunk.outputs[0].token_ids_diff for chunk in chunks), []) == final.token_ids
    assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_streamed_text_never_shows_the_start_of_a_stop_string(llm):
    free = llm.generate("The capital of France is", SamplingParams(max_tokens=12)).outputs[0].text
    stop = free[len(" Paris.") : len(" Paris.") + 6]  # begins right after " Paris."

    async def run():
        return [chunk async for chunk in llm.generate_async(
            "The capital of France is", SamplingParams(max_tokens=12, stop=[stop]), streaming=True)]

    chunks = asyncio.run(run())
    assert chunks[-1].outputs[0].text == " Paris."
    sent = ""
    for chunk in chunks:
        sent += chunk.outputs[0].text_diff
        assert " Paris.".startswith(sent)  # no character the final text lacks is ever sent
    assert sent == " Paris."
    metrics = chunks[-1].metrics
    assert 0 < metrics["time_to_first_token"] <= metrics["e2e_latency"]


def test_cancelling_a_request_frees_its_blocks_and_others_continue(llm):
    async def run():
        task = asyncio.ensure_future(llm.generate_async("Tell me a long story:",
                                                        SamplingParams(max_tokens=500, ignore_eos=True)))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await llm.generate_async("The capital of France is", SamplingParams(max_tokens=3))

    other = asyncio.run(run())
    assert other.outputs[0].text.startswith(" Paris")
    assert _used_blocks(llm) == 0


def test_leaving_a_stream_early_aborts_the_request(llm):
    async def run():
        result = llm.generate_async("Count to one hundred:", SamplingParams(max_tokens=400, ignore_eos=True),
                                    streaming=True)
        async for chunk in result:
            if len(chunk.outputs[0].token_ids) >= 3:
                break
        await asyncio.sleep(0.5)
        return result

    result = asyncio.run(run())
    assert result.finished
    assert _used_blocks(llm) == 0


def test_sync_iteration_streams_and_abort_finishes(llm):
    result = llm.generate_async("Once upon a time", SamplingParams(max_tokens=300, ignore_eos=True), streaming=True)
    chunks = []
    for chunk in result:
        chunks.append(chunk)
        if len(chunks) == 2:
            result.abort()
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "abort"
    assert len(chunks[-1].outputs[0].token_ids) < 300


# ---------------------------------------------------------------------- n, best_of, seeds


def test_n_greater_than_one_shares_the_prompt_blocks(llm):
    prompt = llm.tokenizer.encode("word " * 200)[:64]  # exactly four blocks of 16
    llm.get_stats(timeout=0)
    output = llm.generate(prompt, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True))
    peak = max(s["kvCacheStats"]["usedNumBlocks"] for s in llm.get_stats(timeout=0.5))
    assert len(output.outputs) == 4
    # Shared: 4 prompt blocks + one block per sequence for its tokens; unshared would be 4 * 5 = 20.
    assert 5 <= peak <= 8
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    def sample(seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed)
        return llm.generate("My favourite animal is", params).outputs[0].token_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    batch = llm.generate(["My favourite animal is", "Other prompt"],
                         SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7), use_tqdm=False)
    assert batch[0].outputs[0].token_ids == sample(7)


def test_seeds_anywhere_in_the_64_bit_range_sample_and_forked_sequences_too(llm):
    def sample(seed, n=1):
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, n=n)
        return [c.token_ids for c in llm.generate("My favourite animal is", params).outputs]

    assert sample(-1) == sample(2**64 - 1)  # a negative seed stands for seed + 2**64
    for seed in (2**64 - 1, -(2**63), 2**62):
        forked = sample(seed, n=3)
        assert len(forked) == 3 and forked == sample(seed, n=3)


def test_a_temperature_below_1e_5_decodes_greedily(llm):
    greedy = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0)).outputs[0]
    for temperature in (1e-45, 1e-6):
        tiny = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=temperature,
                                                                       logprobs=0)).outputs[0]
        assert tiny.token_ids == greedy.token_ids
        assert all(entry[token].rank == 1 for token, entry in zip(tiny.token_ids, tiny.logprobs))


def test_best_of_returns_the_most_likely_of_its_candidates(llm):
    params = SamplingParams(n=1, best_of=4, max_tokens=8, temperature=1.0, seed=11)
    output = llm.generate("The weather today is", params)
    assert len(output.outputs) == 1
    everything = llm.generate("The weather today is", SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11))
    best = max(c.cumulative_logprob for c in everything.outputs)
    assert output.outputs[0].cumulative_logprob == pytest.approx(best)


# ---------------------------------------------------------------------- stopping


def test_stop_string_spanning_token_boundary_is_cut(llm):
    free = llm.generate("The capital of France is", SamplingParams(max_tokens=12)).outputs[0]
    pieces = [llm.tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token and the start of the next.
    index = next(i for i in range(1, len(pieces)) if len(pieces[i - 1]) >= 2 and len(pieces[i]) >= 1)
    stop = pieces[index - 1][-2:] + pieces[index][:1]
    cut = free.text.index(stop)
    output = llm.generate("The capital of France is", SamplingParams(max_tokens=12, stop=[stop])).outputs[0]
    assert output.text == free.text[:cut]
    assert output.finish_reason == "stop" and output.stop_reason == stop
    kept = llm.generate("The capital of France is", SamplingParams(max_tokens=12, stop=stop,
                                                                   include_stop_str_in_output=True)).outputs[0]
    assert kept.text == free.text[: cut + len(stop)]


def test_stop_token_ids_end_the_sequence_without_their_text(llm):
    free = llm.generate("The capital of France is", SamplingParams(max_tokens=8)).outputs[0]
    stop_id = free.token_ids[2]
    output = llm.generate("The capital of France is", SamplingParams(max_tokens=8, stop_token_ids=[stop_id]))
    completion = output.outputs[0]
    assert completion.token_ids == free.token_ids[:3]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.text == llm.tokenizer.decode(free.token_ids[:2])


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                               add_generation_prompt=True)
    natural = llm.generate(prompt, SamplingParams(max_tokens=64)).outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == llm.tokenizer.eos_token_id
    forced = llm.generate(prompt, SamplingParams(max_tokens=len(natural.token_ids) + 5, ignore_eos=True))
    assert len(forced.outputs[0].token_ids) == len(natural.token_ids) + 5
    delayed = llm.generate(prompt, SamplingParams(max_tokens=64, min_tokens=len(natural.token_ids) + 2))
    assert len(delayed.outputs[0].token_ids) >= len(natural.token_ids) + 2


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda llm: llm.generate(""), ValueError, "empty"),
        (lambda llm: llm.generate([]), ValueError, "at least one prompt"),
        (lambda llm: llm.generate("x " * 1100), ValueError, "max_seq_len"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=1024)), ValueError, "max_seq_len"),
        (lambda llm: llm.generate([10**9]), ValueError, "token ids must be in"),
        (lambda llm: llm.generate(3.5), TypeError, "inputs must be"),
        (lambda llm: llm.generate("hi", priority=2.0), ValueError, "priority"),
        (lambda llm: SamplingParams(temperature=-1.0), ValueError, "temperature"),
        (lambda llm: SamplingParams(top_p=float("nan")), ValueError, "top_p"),
        (lambda llm: llm.generate("hi", {"max_tokens": 3}), TypeError, "SamplingParams"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(llm, call, error, match):
    with pytest.raises(error, match=match):
        call(llm)
    assert llm.generate("The capital of France is", SamplingParams(max_tokens=2)).outputs[0].text == " Paris."


def test_bad_requests_do_not_disturb_a_request_in_flight(llm):
    expected = llm.generate("The capital of France is", SamplingParams(max_tokens=40, ignore_eos=True))
    running = llm.generate_async("The capital of France is", SamplingParams(max_tokens=40, ignore_eos=True))
    for bad in ("", [10**9], "x " * 1100):
        with pytest.raises(ValueError):
            llm.generate(bad)
    assert running.result(timeout=60).outputs[0].token_ids == expected.outputs[0].token_ids


def test_unknown_llm_argument_is_rejected():
    with pytest.raises(ValueError, match="max_batch_sise"):
        LLM(max_batch_sise=3)


# ---------------------------------------------------------------------- stats, events, lifecycle


def test_stats_capacity_events_and_startup_metrics(llm):
    llm.get_stats(timeout=0)
    llm.get_kv_cache_events(timeout=0)
    llm.generate("A shared prefix that is long enough to fill at least one block of the cache, surely.",
                 SamplingParams(max_tokens=2))
    stats = llm.get_stats(timeout=1)
    assert stats and {"iter", "iterLatencyMS", "cpuMemUsage", "gpuMemUsage", "numActiveRequests",
                      "numQueuedRequests", "kvCacheStats"} <= set(stats[-1])
    assert set(stats[-1]["kvCacheStats"]) == {"maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "tokensPerBlock",
                                              "allocTotalBlocks", "allocNewBlocks", "reusedBlocks", "missedBlocks",
                                              "cacheHitRate"}
    capacity = llm.get_kv_cache_capacity()
    assert capacity == {"maxNumBlocks": 256, "tokensPerBlock": 16, "maxNumTokens": 4096}
    events = llm.get_kv_cache_events(timeout=1)
    assert any(event["data"]["type"] == "stored" for event in events)
    metrics = llm.startup_metrics
    assert metrics["model_loader"]["total_model_loading_seconds"] > 0
    assert math.isfinite(metrics["py_executor"]["total_py_executor_creation_seconds"])

    async def first_stats():
        llm.generate("Hello", SamplingParams(max_tokens=2))
        return [entry async for entry in llm.get_stats_async(timeout=1)]

    assert asyncio.run(first_stats())[0]["iter"] > stats[-1]["iter"]


def test_shutdown_rejects_new_requests(tiny_model_dirs):
    engine = LLM(str(tiny_model_dirs["llama"]), kv_cache_config=KvCacheConfig(max_tokens=256))
    with engine:
        engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate([1, 2, 3])


def test_max_input_len_and_the_capacity_policy_take_effect():
    """max_input_len bounds prompts (beside max_seq_len); scheduler_config's policy reaches the scheduler."""
    with pytest.raises(ValueError, match=r"max_input_len must be < max_seq_len \(8\)"):
        LLM(max_seq_len=8, max_input_len=8)
    with LLM(max_seq_len=256, max_input_len=8, executor="local", kv_cache_config=KvCacheConfig(max_tokens=1024),
             scheduler_config={"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}) as small:
        with pytest.raises(ValueError, match=r"more than max_input_len \(8\)"):
            small.generate([5] * 9)
        assert len(small.generate([5] * 8, SamplingParams(max_tokens=2)).outputs[0].token_ids) == 2
        assert small._executor.worker.engine.scheduler.guarantee_no_evict
