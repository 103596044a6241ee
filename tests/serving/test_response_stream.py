"""Following a response's requests: chunks fold into each request's whole output exactly (increments, or whole
outputs for beam search), deltas pass each chunk's new parts on untouched and report a finish once, and a
ResponseStream merges prompts, counts usage, fails as the route answers and aborts what it leaves."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from raylm import CompletionOutput, RequestError, RequestOutput, SamplingParams
from raylm.serving.engine_stream import OutputChunk
from raylm.serving.errors import OpenAIError
from raylm.serving.metrics import ServingMetrics
from raylm.serving.response_stream import RequestProgress, ResponseStream
from tests.serving.conftest import encoded


def _without_diffs(output: RequestOutput) -> RequestOutput:
    """The output as a whole: the driver's diffs since its previous output left out."""
    outputs = [dataclasses.replace(completion, text_diff="", token_ids_diff=[], logprobs_diff=[])
               for completion in output.outputs]
    return dataclasses.replace(output, outputs=outputs)


def _fold(chunks: list[OutputChunk]) -> list[RequestOutput]:
    progress, rebuilt = RequestProgress(0), []
    for chunk in chunks:
        progress.add(chunk)
        rebuilt.append(progress.output())
    return rebuilt


def test_folded_chunks_rebuild_every_output_with_logprobs_and_n(llm):
    params = SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=3, logprobs=2, prompt_logprobs=1, stop=["."])
    outputs, chunks = encoded(llm, "The capital of France is", params)
    assert len(outputs) > 3 and _fold(chunks) == [_without_diffs(output) for output in outputs]


def test_beam_search_whole_chunks_rebuild_exactly(llm):
    outputs, chunks = encoded(llm, "Once upon a time", SamplingParams(max_tokens=6, n=2, use_beam_search=True))
    rebuilt = _fold(chunks)
    assert rebuilt == [_without_diffs(output) for output in outputs] and len(rebuilt[-1].outputs) == 2


def _chunk(*completions: CompletionOutput, finished: bool = False, first: bool = False) -> OutputChunk:
    return OutputChunk("7", finished=finished, num_cached_tokens=0, metrics={}, completions=list(completions),
                       prompt="Hi" if first else None, prompt_token_ids=[1, 2] if first else None, first=first)


def test_deltas_are_the_chunks_new_parts_untouched_and_a_finish_is_reported_once():
    progress = RequestProgress(3)
    first = CompletionOutput(0, text="He", token_ids=[10])
    deltas = progress.add(_chunk(first, CompletionOutput(1), first=True))
    assert [(d.completion.index, d.is_first, d.prompt_index) for d in deltas] == [(0, True, 3), (1, True, 3)]
    assert deltas[0].completion is first
    assert deltas[0].request.prompt == "Hi" and deltas[0].request.prompt_token_ids == [1, 2]
    ended = CompletionOutput(1, text="!", token_ids=[12], finish_reason="stop")
    deltas = progress.add(_chunk(CompletionOutput(0), ended))
    assert [(d.completion.index, d.is_first) for d in deltas] == [(1, False)] and deltas[0].completion is ended
    # The finished choice comes again with every later output, and is passed over.
    deltas = progress.add(_chunk(CompletionOutput(0, text="llo", token_ids=[11], finish_reason="length"),
                                 CompletionOutput(1, finish_reason="stop"), finished=True))
    assert [(d.completion.index, d.completion.text) for d in deltas] == [(0, "llo")]
    whole = progress.output()
    assert [(c.text, c.token_ids, c.finish_reason) for c in whole.outputs] == [("Hello", [10, 11], "length"),
                                                                               ("!", [12], "stop")]
    assert progress.finished and progress.generated_lengths == [2, 1] and progress.finish_reason == "length"


class FakeStream:
    """A GenerationStream that yields its chunks (raising those that are exceptions), then waits if `hang`."""

    def __init__(self, chunks: list, hang: bool = False):
        self.chunks = chunks
        self.hang = hang
        self.aborted = False

    async def admitted(self) -> None:
        pass

    async def __aiter__(self):
        for chunk in self.chunks:
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk
            await asyncio.sleep(0)
        if self.hang:
            await asyncio.Event().wait()

    def abort(self) -> None:
        self.aborted = True


def _stream(streams: list[FakeStream]) -> ResponseStream:
    return ResponseStream(streams, ServingMetrics("test"), lambda exc: OpenAIError(500, f"failed: {exc}"))


def test_a_response_stream_merges_its_prompts_and_counts_their_usage():
    streams = [FakeStream([_chunk(CompletionOutput(0, text="a", token_ids=[5]), first=True),
                           _chunk(CompletionOutput(0, text="b", token_ids=[6], finish_reason="length"),
                                  finished=True)]) for _ in range(2)]
    stream = _stream(streams)

    async def run() -> list[tuple[int, str]]:
        return [(delta.prompt_index, delta.completion.text) async for delta in stream]

    deltas = asyncio.run(run())
    assert sorted(deltas) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert [output.outputs[0].text for output in stream.outputs()] == ["ab", "ab"]
    usage = stream.usage()
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 4, 8)


def test_a_failed_request_raises_the_routes_error_and_aborts_the_others():
    streams = [FakeStream([_chunk(CompletionOutput(0, text="a", token_ids=[5]), first=True)], hang=True),
               FakeStream([RequestError("boom")])]

    async def run() -> None:
        async for _ in _stream(streams):
            pass

    with pytest.raises(OpenAIError, match="failed: boom"):
        asyncio.run(run())
    assert all(stream.aborted for stream in streams)


def test_leaving_early_aborts_every_request():
    streams = [FakeStream([_chunk(CompletionOutput(0, text="a", token_ids=[5]), first=True)], hang=True)
               for _ in range(2)]

    async def run() -> None:
        deltas = aiter(_stream(streams))
        await anext(deltas)
        await deltas.aclose()

    asyncio.run(run())
    assert all(stream.aborted for stream in streams)
