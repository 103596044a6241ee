"""PoolingEngine: batches waiting encode requests in arrival order within max_batch_size and max_num_tokens, runs
each prompt whole, and reports an embedding (or an error) per request; aborts, pauses and refusals."""

from __future__ import annotations

import pytest
import torch

from raylm.engine.messages import EncodeRequest, EngineRequest
from raylm.engine.pooling_engine import PoolingEngine
from raylm.sampling_params import SamplingParams


class RecordingRunner:
    """Embeds a prompt as [its length, its first token]; records each batch."""

    def __init__(self, fail: bool = False):
        self.batches: list[list[list[int]]] = []
        self.fail = fail

    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        self.batches.append(prompts)
        if self.fail:
            raise RuntimeError("device lost")
        return torch.tensor([[float(len(prompt)), float(prompt[0])] for prompt in prompts])


def _engine(max_batch_size: int = 3, max_num_tokens: int = 10, fail: bool = False) -> PoolingEngine:
    return PoolingEngine(RecordingRunner(fail), max_batch_size, max_num_tokens)


def _add(engine: PoolingEngine, *lengths: int) -> None:
    for index, length in enumerate(lengths):
        engine.add_request(EncodeRequest(f"r{len(engine._ids)}-{index}", [index + 1] * length))


def test_batches_fill_in_arrival_order_up_to_the_batch_and_token_budgets():
    engine = _engine()
    _add(engine, 2, 2, 2, 2, 7, 4, 10)
    sizes = []
    while engine.has_work:
        output = engine.step()
        sizes.append([len(prompt) for prompt in engine.runner.batches[-1]])
        assert all(delta.finished and delta.error is None for delta in output.deltas)
    assert sizes == [[2, 2, 2], [2, 7], [4], [10]]


def test_each_request_gets_the_row_of_its_own_prompt_copied_out_of_the_batch():
    engine = _engine()
    engine.add_request(EncodeRequest("a", [7, 1, 1]))
    engine.add_request(EncodeRequest("b", [9]))
    deltas = {delta.request_id: delta for delta in engine.step().deltas}
    assert deltas["a"].embedding.tolist() == [3.0, 7.0] and deltas["b"].embedding.tolist() == [1.0, 9.0]
    assert deltas["a"].embedding.untyped_storage().nbytes() == 2 * 4  # pickles its own values only


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on():
    engine = _engine(fail=True)
    _add(engine, 2, 3)
    deltas = engine.step().deltas
    assert [delta.error for delta in deltas] == ["engine step failed: RuntimeError: device lost"] * 2
    assert not engine.has_work


def test_refusals_name_what_is_wrong():
    engine = _engine()
    with pytest.raises(ValueError, match=r"prompt has 11 tokens, more than max_num_tokens \(10\)"):
        engine.add_request(EncodeRequest("long", [1] * 11))
    with pytest.raises(ValueError, match="encode_only.*cannot generate"):
        engine.add_request(EngineRequest("gen", [1, 2], SamplingParams()))
    engine.add_request(EncodeRequest("x", [1]))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EncodeRequest("x", [1]))


def test_abort_and_pause_end_waiting_requests_with_an_error():
    engine = _engine()
    _add(engine, 1, 1, 1)
    assert engine.abort_request("r0-0").error == "the request was aborted"
    assert engine.abort_request("r0-0") is None
    engine.pause(abort=False)
    assert not engine.has_work
    assert engine.pause(abort=True) == 2
    assert {delta.error for delta in engine.take_control_deltas()} == {"generation paused"}
    engine.resume_generation()
    assert not engine.has_work and engine.runner.batches == []
