"""The stream between the engine deployment and the ingress: chunks rebuild every output exactly (increments, or
whole outputs for beam search), and stream_request admits, rejects and aborts as the engine does."""

from __future__ import annotations

import asyncio
import pickle

from raylm import SamplingParams
from raylm.serving.engine_stream import (
    Admitted,
    ChunkDecoder,
    ChunkEncoder,
    Failed,
    OutputChunk,
    Rejected,
    outputs_only_grow,
    stream_request,
)
from tests.serving.conftest import used_blocks


def _round_trip(llm, prompt, params: SamplingParams) -> tuple[list, list]:
    """Every streamed output of a request, and what the decoder rebuilt from its pickled chunks."""

    async def run():
        encoder, decoder = ChunkEncoder(outputs_only_grow(params)), ChunkDecoder()
        originals, rebuilt = [], []
        async for output in llm.generate_async(prompt, params, streaming=True):
            chunk = pickle.loads(pickle.dumps(encoder.encode(output)))  # as Ray sends it
            originals.append(output)
            rebuilt.append(decoder.decode(chunk))
        return originals, rebuilt

    return asyncio.run(run())


def test_increments_rebuild_every_output_with_logprobs_and_n(llm):
    params = SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=3, logprobs=2, prompt_logprobs=1,
                            stop=["."])
    originals, rebuilt = _round_trip(llm, "The capital of France is", params)
    assert len(originals) > 3 and rebuilt == originals
    assert rebuilt[-1].finished and rebuilt[-1].prompt == "The capital of France is"


def test_beam_search_sends_whole_outputs_that_rebuild_exactly(llm):
    params = SamplingParams(max_tokens=6, n=2, use_beam_search=True)
    assert not outputs_only_grow(params) and outputs_only_grow(SamplingParams(n=2))
    originals, rebuilt = _round_trip(llm, "Once upon a time", params)
    assert rebuilt == originals and len(rebuilt[-1].outputs) == 2


def test_an_increment_carries_only_the_new_tokens(llm):
    encoder = ChunkEncoder(incremental=True)

    async def chunks() -> list[OutputChunk]:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        return [encoder.encode(output) async for output in llm.generate_async("Hello", params, streaming=True)]

    sent = asyncio.run(chunks())
    assert [len(chunk.completions[0].token_ids) for chunk in sent] == [1] * 5
    assert sent[0].prompt_token_ids and all(chunk.prompt_token_ids is None for chunk in sent[1:])


def _messages(llm, prompt, params: SamplingParams, keep: int | None = None) -> list:
    async def run() -> list:
        messages = []
        stream = stream_request(llm, prompt, params, streaming=True, priority=0.5, cache_salt=None)
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
