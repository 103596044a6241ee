"""/v1/chat/completions through the official openai client: the chat template, multi-turn and content parts,
exact usage, streaming, n and logprobs."""

from __future__ import annotations

from raylm import SamplingParams, TokensPrompt
from tests.serving.conftest import MODEL

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Name another one."},
]


def test_chat_renders_the_template_and_counts_prompt_tokens_exactly(client, llm):
    response = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_completion_tokens=6,
                                              temperature=0)
    prompt_ids = llm.tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    reference = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids),
                             SamplingParams(max_tokens=6, temperature=0)).outputs[0]
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert choice.finish_reason == ("length" if len(reference.token_ids) == 6 else "stop")
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(reference.token_ids)
    assert response.usage.total_tokens == len(prompt_ids) + len(reference.token_ids)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"


def test_text_content_parts_and_developer_role_equal_their_plain_forms(client):
    plain = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi.\nNow."}])
    parts = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Say hi."}, {"type": "text", "text": "Now."}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_chat_equals_non_streamed_with_role_first_and_usage_last(client):
    kwargs = dict(model=MODEL, messages=CONVERSATION, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(choice.delta.role is None for chunk in chunks[1:] for choice in chunk.choices)
    text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)


def test_n_choices_and_logprobs_with_top_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=4, n=2,
                                              temperature=1.0, seed=5, logprobs=True, top_logprobs=3)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert response.usage.completion_tokens == sum(len(c.logprobs.content) for c in response.choices)
    for choice in response.choices:
        assert "".join(entry.token for entry in choice.logprobs.content).startswith(choice.message.content)
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
            assert [top.logprob for top in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                         reverse=True)
            assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_n_choices_each_equal_their_non_streamed_text(client):
    kwargs = dict(model=MODEL, messages=CONVERSATION, max_tokens=5, n=2, temperature=1.0, seed=3)
    whole = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
