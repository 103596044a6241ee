"""Step plans (engine/step_plan.py): a schedule flattened for every rank, made without changing the requests;
the engine's progress moves prompt log-probabilities on once the step is launched."""

from __future__ import annotations

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.progress import Progress
from raylm.engine.request import Request
from raylm.engine.scheduler import Scheduler
from raylm.engine.step_plan import plan_step
from raylm.sampling_params import SamplingParams

BLOCK = 4


def _scheduled(*prompts: list[int], budget: int = 64, **params):
    kv_cache = KVCacheManager(num_blocks=32, block_size=BLOCK, enable_block_reuse=False, event_buffer_max_size=0)
    scheduler = Scheduler(kv_cache, max_batch_size=8, max_num_tokens=budget)
    for index, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{index}", prompt, SamplingParams(max_tokens=4, **params)))
    return scheduler, scheduler.schedule()


def _state(out) -> list:
    """What a runner might write of the scheduler's requests and sequences."""
    return [(item.request.prompt_logprobs_next, item.request.status, [
        (list(seq.token_ids), seq.num_computed_tokens, list(seq.block_ids), seq.sampling_row)
        for seq in item.request.sequences]) for item in out.scheduled]


def test_planning_changes_no_request():
    _, out = _scheduled([1, 2, 3, 4, 5, 6], [7, 8, 9], prompt_logprobs=1, temperature=0.5, seed=3)
    before = _state(out)
    plan = plan_step(out, BLOCK)
    again = plan_step(out, BLOCK)
    assert _state(out) == before
    assert plan == again  # the same schedule plans the same step
    assert plan.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9] and plan.sample_rows == [5, 8]
    assert [spec.targets for spec in plan.prompt_logprobs] == [[2, 3, 4, 5, 6], [8, 9]]


def test_launching_moves_prompt_logprobs_past_the_planned_positions():
    """A chunked prompt reports each position once: the next chunk's plan starts where the launched one ended."""
    scheduler, out = _scheduled([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], budget=4, prompt_logprobs=0)
    progress = Progress(scheduler, max_seq_len=64)
    first = plan_step(out, BLOCK)
    assert [spec.targets for spec in first.prompt_logprobs] == [[2, 3, 4, 5]]
    progress.launched(out, placeholders=False)
    assert out.scheduled[0].request.prompt_logprobs_next == 5
    second = plan_step(scheduler.schedule(), BLOCK)
    assert [spec.targets for spec in second.prompt_logprobs] == [[6, 7, 8, 9]]


def test_short_prompts_become_rows_of_their_own_where_the_prefill_graphs_hold_them():
    """graph_rows: a step of at most that many rows gives each prompt token a decode row of its own (verify rows,
    each attending to its prefix, for the prefill graphs), with the same tokens, slots, sampled rows and prompt
    log-probabilities as the chunks it replaces; a step of more rows keeps its prefill chunks."""
    _, out = _scheduled([1, 2, 3, 4, 5, 6], [7, 8, 9], prompt_logprobs=1)
    chunks = plan_step(out, BLOCK)
    rows = plan_step(out, BLOCK, graph_rows=9)
    assert chunks.prefill_chunks and not chunks.decode_contexts and not chunks.verify_rows
    assert not rows.prefill_chunks and rows.verify_rows and not rows.greedy
    blocks = [item.seq.block_ids for item in out.scheduled]
    assert rows.decode_contexts == [(blocks[0], p + 1) for p in range(6)] + [(blocks[1], p + 1) for p in range(3)]
    for field in ("input_ids", "positions", "slot_mapping", "sample_rows", "prompt_logprobs"):
        assert getattr(rows, field) == getattr(chunks, field), field
    assert plan_step(out, BLOCK, graph_rows=8) == chunks
