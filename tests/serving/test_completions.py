"""/v1/completions through the official openai client: text, usage, streaming, n, stop, seed, echo + logprobs,
token-id prompts and prompt lists."""

from __future__ import annotations

import time

import pytest

from raylm import SamplingParams
from tests.serving.conftest import MODEL, check_long_stream_sends_only_new_parts

PROMPT = "The capital of France is"


def _stream_text(client, **kwargs) -> tuple[dict[int, str], list]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts, chunks


def test_greedy_completion_equals_the_engine_and_counts_tokens_exactly(client, llm):
    before = int(time.time())
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0)).outputs[0]
    choice = response.choices[0]
    assert choice.text == reference.text and choice.text.startswith(" Paris")
    assert choice.finish_reason == "length" and choice.index == 0
    prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 6)
    assert response.usage.total_tokens == prompt_tokens + 6
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == MODEL and before <= response.created <= int(time.time())


def test_streamed_text_equals_non_streamed_and_include_usage_sends_a_final_usage_chunk(client):
    kwargs = dict(prompt="Write a haiku about the sea:", max_tokens=12, temperature=0)
    whole = client.completions.create(model=MODEL, **kwargs)
    texts, chunks = _stream_text(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {0: whole.choices[0].text}
    assert len(chunks) > 3
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    finished = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finished == ["length"]
    assert len({chunk.id for chunk in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_a_long_streamed_completion_sends_each_piece_of_text_once(client):
    check_long_stream_sends_only_new_parts(client, MODEL, max_tokens=128)


def test_continuous_usage_stats_count_tokens_so_far_in_every_chunk(client):
    _, chunks = _stream_text(client, prompt=PROMPT, max_tokens=5, temperature=0,
                             stream_options={"continuous_usage_stats": True})
    generated = [chunk.usage.completion_tokens for chunk in chunks]
    assert generated == sorted(generated) and generated[-1] == 5
    assert all(chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
               for chunk in chunks)


def test_n_returns_n_choices_and_usage_counts_every_choice(client):
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=2,
                                         temperature=1.0, seed=11)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 10
    texts, _ = _stream_text(client, prompt="Once upon a time", max_tokens=5, n=2, temperature=1.0, seed=11)
    assert sorted(texts) == [0, 1]
    best = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, n=1, best_of=3,
                                     temperature=1.0, seed=11)
    assert len(best.choices) == 1 and best.usage.completion_tokens == 5


def test_stop_string_ends_the_text_before_it_streamed_or_not(client):
    # Greedy continues " Paris.\n\nThe answer is: ..."; the stop string spans several tokens, so a stream
    # must hold back "\n\nThe" until it knows whether the stop string follows.
    kwargs = dict(prompt=PROMPT, max_tokens=16, temperature=0, stop=["\n\nThe answer", "never appears"])
    response = client.completions.create(model=MODEL, **kwargs)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (" Paris.", "stop")
    assert choice.model_extra["stop_reason"] == "\n\nThe answer"
    texts, _ = _stream_text(client, **kwargs)
    assert texts == {0: " Paris."}
    single = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=".")
    assert single.choices[0].text == " Paris"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8,
                                         temperature=1.0, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert any(sample(seed) != sample(7) for seed in (8, 9, 10))


def test_top_logprobs_list_the_sampled_token_even_outside_the_top_k(client):
    choice = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=24,
                                       temperature=1.5, seed=4, logprobs=1).choices[0]
    logprobs = choice.logprobs
    outside = 0
    for token, token_logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == token_logprob
        best = max(top.values())
        if token_logprob < best:  # sampled outside the top 1: listed after it
            outside += 1
            assert len(top) == 2
        else:
            assert len(top) == 1
    assert outside > 0


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_returns_prompt_logprobs_as_loglikelihood_scoring_needs(client, llm, max_tokens):
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1,
                                         temperature=0)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(llm.tokenizer.decode(ids))
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=1)).prompt_logprobs
    for position in range(1, len(ids)):
        expected = reference[position][ids[position]].logprob
        assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-4)
        top = logprobs.top_logprobs[position]
        # The most likely token, and the prompt's own token when it is another.
        is_most_likely = reference[position][ids[position]].rank == 1
        assert len(top) == (1 if is_most_likely else 2)
        assert top[logprobs.tokens[position]] == logprobs.token_logprobs[position]
        assert max(top.values()) >= logprobs.token_logprobs[position] - 1e-6
    assert logprobs.tokens[1] == " quick" and logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == max_tokens
    if max_tokens == 0:
        assert choice.text == llm.tokenizer.decode(ids)


def test_echo_streams_the_prompt_first(client):
    texts, chunks = _stream_text(client, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert texts == {0: whole.choices[0].text} and whole.choices[0].text.startswith(PROMPT + " Paris")


def test_token_id_prompts_and_prompt_lists_give_one_choice_per_prompt_in_order(client, llm):
    prompts = [PROMPT, "Hello, my name is"]
    ids = [llm.tokenizer.encode(prompt) for prompt in prompts]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
               for p in prompts]
    assert client.completions.create(model=MODEL, prompt=ids[0], max_tokens=4,
                                     temperature=0).choices[0].text == singles[0]
    for batch in (prompts, ids):
        response = client.completions.create(model=MODEL, prompt=batch, max_tokens=4, temperature=0)
        assert [choice.text for choice in response.choices] == singles
        assert [choice.index for choice in response.choices] == [0, 1]
        assert response.usage.prompt_tokens == sum(len(i) for i in ids)
        assert response.usage.completion_tokens == 8
    texts, _ = _stream_text(client, prompt=prompts, max_tokens=4, temperature=0)
    assert texts == {0: singles[0], 1: singles[1]}


def test_extension_parameters_reach_the_engine(client, llm):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6, "top_k": 5, "min_p": 0.01, "repetition_penalty": 1.3},
    )
    reference = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, min_tokens=6,
                                                    top_k=5, min_p=0.01, repetition_penalty=1.3)).outputs[0]
    assert response.choices[0].text == reference.text
    assert response.usage.completion_tokens == 6
