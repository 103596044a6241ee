"""actors/distributed_runner.py: pipeline micro-batches are contiguous slices of a step with about equal token
counts."""

from __future__ import annotations

import pytest

from raylm.actors.distributed_runner import split_schedule
from raylm.engine.scheduler import ScheduledSequence, SchedulerOutput


def _items(tokens: list[int]) -> list[ScheduledSequence]:
    return [ScheduledSequence(request=None, seq=None, start=0, num_tokens=n) for n in tokens]


def _step(decodes: int, prefill_chunks: list[int]) -> SchedulerOutput:
    return SchedulerOutput(decodes=_items([1] * decodes), prefills=_items(prefill_chunks),
                           block_copies=[(3, 4)])


def _tokens(pieces: list[SchedulerOutput]) -> list[int]:
    return [piece.num_tokens for piece in pieces]


def test_prefill_chunks_are_shared_out_by_tokens():
    """200 decodes then 8 chunks of 1,000 tokens: not 101 decodes against 99 decodes and all 8,000 prefill
    tokens, but ~4,100 tokens each."""
    out = _step(200, [1000] * 8)
    pieces = split_schedule(out, 2)
    assert _tokens(pieces) == [4200, 4000]
    assert [item for piece in pieces for item in piece.scheduled] == out.scheduled  # order kept
    assert pieces[0].block_copies == [(3, 4)] and pieces[1].block_copies == []


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_decodes_split_evenly_and_no_slice_is_empty(parts):
    pieces = split_schedule(_step(10, []), parts)
    assert len(pieces) == parts
    assert max(_tokens(pieces)) - min(_tokens(pieces)) <= 1
    pieces = split_schedule(_step(0, [5000, 1, 1]), 3)  # one large chunk: still three non-empty slices
    assert _tokens(pieces) == [5000, 1, 1]


def test_fewer_sequences_than_stages():
    pieces = split_schedule(_step(1, [700]), 4)
    assert _tokens(pieces) == [1, 700]
    assert _tokens(split_schedule(_step(3, []), 1)) == [3]
