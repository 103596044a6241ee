"""The stream of chunks a request's outputs become: a chunk carries only what its output added (whole outputs for
beam search), and stream_request admits, rejects and aborts as the engine does."""

from __future__ import annotations

import asyncio

from raylm import SamplingParams
from raylm.serving.engine_stream import (
    Admitted,
    Failed,
    OutputChunk,
    Rejected,
    chunk_from_wire,
    chunk_to_wire,
    merge_chunks,
    output_chunks,
    outputs_only_grow,
    stream_request,
)
from tests.serving.conftest import encoded, used_blocks


def test_an_increment_carries_only_the_new_tokens_text_and_logprobs(llm):
    outputs, sent = encoded(llm, "Hello", SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1))
    assert [len(chunk.completions[0].token_ids) for chunk in sent] == [1] * 5
    assert [len(chunk.completions[0].logprobs) for chunk in sent] == [1] * 5
    assert [chunk.completions[0].text for chunk in sent] == [output.outputs[0].text_diff for output in outputs]
    assert sent[0].first and sent[0].prompt_token_ids and all(chunk.prompt_token_ids is None for chunk in sent[1:])
    assert not any(chunk.whole for chunk in sent) and sent[-1].finished


def test_beam_search_sends_whole_outputs(llm):
    params = SamplingParams(max_tokens=6, n=2, use_beam_search=True)
    assert not outputs_only_grow(params) and outputs_only_grow(SamplingParams(n=2))
    outputs, sent = encoded(llm, "Once upon a time", params)
    assert all(chunk.whole for chunk in sent) and sent[-1].completions == outputs[-1].outputs


def test_output_chunks_streams_a_local_request_as_the_encoder_does(llm):
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def run() -> list[OutputChunk]:
        return [chunk async for chunk in output_chunks(llm.generate_async("Hello", params, streaming=True), params)]

    chunks = asyncio.run(run())
    assert len(chunks) == 4 and chunks[0].first and chunks[-1].finished
    assert "".join(chunk.completions[0].text for chunk in chunks) == llm.generate("Hello", params).outputs[0].text


def _messages(llm, prompt, params: SamplingParams, keep: int | None = None) -> list:
    async def run() -> list:
        messages = []
        stream = stream_request(llm, prompt, params, priority=0.5, cache_salt=None)
        async for message in stream:
            messages.append(message)
            if keep is not None and len(messages) == keep:
                await stream.aclose()  # what cancelling the Serve call does to the replica's generator
                break
        return messages

    return asyncio.run(run())


def test_stream_request_admits_then_streams_and_rejects_bad_input_as_the_engine_raises_it(llm):
    messages = _messages(llm, "Hello", SamplingParams(max_tokens=3))
    assert isinstance(messages[0], Admitted) and all(isinstance(m, OutputChunk) for m in messages[1:])
    assert messages[-1].finished
    [rejected] = _messages(llm, [999999], SamplingParams(max_tokens=3))
    assert isinstance(rejected, Rejected) and rejected.kind == "ValueError"
    assert isinstance(rejected.error(), ValueError) and "prompt token ids" in str(rejected.error())
    assert Rejected.from_error(RuntimeError("x")).kind == "RuntimeError" and Failed("boom").message == "boom"


def test_closing_the_stream_early_aborts_the_request_and_frees_its_blocks(llm):
    messages = _messages(llm, "Count to one thousand:", SamplingParams(max_tokens=900, ignore_eos=True), keep=3)
    assert len(messages) == 3 and not messages[-1].finished
    assert used_blocks(llm) == 0


def _followed(chunks: list[OutputChunk]):
    from raylm.serving.response_stream import RequestProgress

    progress = RequestProgress(0)
    for chunk in chunks:
        progress.add(chunk)
    return progress.output()


def test_merged_chunks_say_what_the_chunks_said(llm):
    """However a request's chunks are grouped into messages, the output followed from them is the same."""
    for params in (SamplingParams(max_tokens=7, n=2, seed=3, ignore_eos=True, logprobs=1, prompt_logprobs=1),
                   SamplingParams(max_tokens=5, n=2, use_beam_search=True)):
        _, chunks = encoded(llm, "Once upon a time", params)
        expected = _followed(chunks)
        for groups in ([chunks], [chunks[:1], chunks[1:4], chunks[4:]], [chunks[:3], chunks[3:]]):
            merged = [merge_chunks(group) for group in groups if group]
            assert merged[0].first and merged[-1].finished
            followed = _followed(merged)
            assert followed.outputs == expected.outputs
            assert followed.prompt_logprobs == expected.prompt_logprobs
            assert followed.prompt_token_ids == expected.prompt_token_ids


def test_the_engine_deployment_sends_queued_chunks_as_one_message(llm):
    from raylm.serving.ray_serve import _END, _queued_chunks

    _, chunks = encoded(llm, "Hello", SamplingParams(max_tokens=4, ignore_eos=True))

    def queue_of(*items) -> asyncio.Queue:
        queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        return queue

    admitted, failed = Admitted("r"), Failed("boom")
    assert _queued_chunks(admitted, queue_of(*chunks)) == ([], admitted)
    queue = queue_of(*chunks[1:], _END)
    assert _queued_chunks(chunks[0], queue) == (chunks, _END) and queue.empty()
    assert _queued_chunks(chunks[0], queue_of(chunks[1], failed, chunks[2])) == (chunks[:2], failed)
    assert _queued_chunks(chunks[0], queue_of()) == (chunks[:1], None)
    merged = merge_chunks(chunks)
    assert merged.completions[0].token_ids == [t for chunk in chunks for t in chunk.completions[0].token_ids]


def test_a_chunk_crosses_between_replicas_as_plain_tuples_and_comes_back_equal(llm):
    """The engine deployment sends chunks as tuples (chunk_to_wire); the ingress rebuilds the same chunks, with
    log-probabilities, prompt log-probabilities and whole (beam search) outputs."""
    import pickle

    for prompt, params in (("Hello", SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)),
                           ("Once upon a time", SamplingParams(max_tokens=3, n=2, use_beam_search=True))):
        _, sent = encoded(llm, prompt, params)
        for chunk in sent:
            wire = chunk_to_wire(chunk)
            assert type(wire) is tuple
            back = chunk_from_wire(pickle.loads(pickle.dumps(wire)))
            assert back == OutputChunk(**{**vars(chunk), "completions": [
                type(c)(index=c.index, text=c.text, token_ids=c.token_ids, cumulative_logprob=c.cumulative_logprob,
                        logprobs=c.logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        weight_versions=c.weight_versions) for c in chunk.completions]})
