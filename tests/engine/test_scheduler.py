"""Scheduler: continuous batching, chunked prefill, priorities, preemption by recompute, prefix-cache hits.

No model runs: `run_step` plays the engine's part (progress.py) after each `schedule()`: it marks the
scheduled tokens computed, keys the blocks they filled, appends a fake sampled token to every sequence
whose last known token was computed (forking a request with n > 1 on its first token), and finishes a
request once each of its sequences has max_tokens outputs.
"""

from __future__ import annotations

import pytest

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.request import Request, RequestStatus
from raylm.engine.scheduler import Scheduler, SchedulerOutput
from raylm.sampling_params import SamplingParams

BLOCK = 4
SAMPLED_TOKEN = 7


def prompt(length: int, start: int = 0) -> list[int]:
    return list(range(start, start + length))


def make_request(request_id: str, tokens: list[int], max_tokens: int = 4, priority: float = 0.5,
                 arrival_time: float = 0.0, n: int = 1, cache_salt: str | None = None,
                 prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, n=n, prompt_logprobs=prompt_logprobs)
    return Request(request_id=request_id, prompt_token_ids=tokens, sampling_params=params, priority=priority,
                   arrival_time=arrival_time, cache_salt=cache_salt)


def make_scheduler(num_blocks: int = 64, max_batch_size: int = 8, max_num_tokens: int = 64,
                   enable_chunked_prefill: bool = True, enable_block_reuse: bool = True) -> Scheduler:
    kv_cache = KVCacheManager(num_blocks, BLOCK, enable_block_reuse)
    return Scheduler(kv_cache, max_batch_size, max_num_tokens, enable_chunked_prefill)


def run_step(scheduler: Scheduler, completes: list[bool] | None = None) -> SchedulerOutput:
    """One engine step; appends to completes whether each scheduled sequence sampled a token."""
    out = scheduler.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        scheduler.kv_cache.register_full_blocks(item.request, item.seq)
        if completes is not None:
            completes.append(item.completes)
        if not item.completes:
            continue
        request = item.request
        if request.sampling_params.n > 1 and not request.forked:
            request.forked = True
            for index in range(1, request.sampling_params.n):
                child = item.seq.fork(index, None)
                scheduler.kv_cache.fork(item.seq, child)
                request.sequences.append(child)
                child.token_ids.append(SAMPLED_TOKEN + index)
        item.seq.token_ids.append(SAMPLED_TOKEN)
    for request in {id(item.request): item.request for item in out.scheduled}.values():
        if all(seq.num_output_tokens >= request.sampling_params.max_tokens for seq in request.sequences):
            scheduler.finish_request(request)
    return out


def run_until_idle(scheduler: Scheduler, max_steps: int = 40,
                   completes: list[bool] | None = None) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_work and len(outs) < max_steps:
        outs.append(run_step(scheduler, completes))
    return outs


def scheduled(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(request id, sequence index, start, tokens) of every scheduled sequence, decodes first."""
    return [(item.request.request_id, item.seq.index, item.start, item.num_tokens) for item in out.scheduled]


# ---------------------------------------------------------------------- basics


def test_scheduler_without_requests_has_no_work_and_schedules_nothing():
    scheduler = make_scheduler()
    assert not scheduler.has_work
    out = scheduler.schedule()
    assert out.is_empty
    assert (out.num_tokens, out.num_preempted, out.block_copies) == (0, 0, [])


def test_request_prefills_its_prompt_then_decodes_one_token_per_step_and_frees_its_blocks():
    scheduler = make_scheduler()
    request = make_request("a", prompt(6), max_tokens=3)
    scheduler.add_request(request)
    assert scheduler.has_work
    assert (request.status, scheduler.waiting) == (RequestStatus.WAITING, [request])

    completes: list[bool] = []
    first = run_step(scheduler, completes)
    assert (scheduled(first), first.decodes) == ([("a", 0, 0, 6)], [])
    assert first.prefills[0].token_ids == prompt(6)
    assert (request.status, scheduler.running, scheduler.waiting) == (RequestStatus.RUNNING, [request], [])
    assert len(request.sequences[0].block_ids) == 2

    second = run_step(scheduler, completes)
    assert (scheduled(second), second.prefills) == ([("a", 0, 6, 1)], [])
    assert len(request.sequences[0].block_ids) == 2

    third = run_step(scheduler, completes)
    assert scheduled(third) == [("a", 0, 7, 1)]
    assert completes == [True, True, True]
    assert request.sequences[0].num_output_tokens == 3
    assert request.status == RequestStatus.FINISHED
    assert not scheduler.has_work
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_finish_request_frees_blocks_and_removes_it_from_either_queue():
    scheduler = make_scheduler(max_batch_size=1)
    running = make_request("a", prompt(6), arrival_time=0)
    waiting = make_request("b", prompt(6, 100), arrival_time=1)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert (scheduler.running, scheduler.waiting) == ([running], [waiting])
    scheduler.finish_request(running)
    scheduler.finish_request(waiting)
    assert (scheduler.running, scheduler.waiting) == ([], [])
    assert running.sequences[0].block_ids == []
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    assert running.status == waiting.status == RequestStatus.FINISHED
    assert scheduler.schedule().is_empty


# ---------------------------------------------------------------------- batch limits


def test_max_batch_size_caps_sequences_per_step_and_later_requests_wait_their_turn():
    scheduler = make_scheduler(max_batch_size=2)
    for index, request_id in enumerate("abc"):
        scheduler.add_request(make_request(request_id, prompt(4, 100 * index), max_tokens=2, arrival_time=index))
    outs = run_until_idle(scheduler)
    assert [[entry[0] for entry in scheduled(out)] for out in outs] == [["a", "b"], ["a", "b"], ["c"], ["c"]]


def test_max_batch_size_counts_every_sequence_of_a_forked_request():
    scheduler = make_scheduler(max_batch_size=2)
    forked = make_request("a", prompt(6), max_tokens=3, n=2, arrival_time=0)
    scheduler.add_request(forked)
    run_step(scheduler)
    assert len(forked.sequences) == 2
    scheduler.add_request(make_request("b", prompt(6, 100), arrival_time=1))
    out = run_step(scheduler)
    assert scheduled(out) == [("a", 0, 6, 1), ("a", 1, 6, 1)]
    assert [request.request_id for request in scheduler.waiting] == ["b"]

    roomier = make_scheduler(max_batch_size=3)
    forked = make_request("a", prompt(6), max_tokens=3, n=2, arrival_time=0)
    roomier.add_request(forked)
    run_step(roomier)
    roomier.add_request(make_request("b", prompt(6, 100), arrival_time=1))
    assert scheduled(run_step(roomier)) == [("a", 0, 6, 1), ("a", 1, 6, 1), ("b", 0, 0, 6)]


def test_token_budget_caps_tokens_per_step_and_chunks_the_prompt_that_overflows_it():
    scheduler = make_scheduler(max_num_tokens=10)
    for index, request_id in enumerate("abc"):
        scheduler.add_request(make_request(request_id, prompt(4, 100 * index), arrival_time=index))
    completes: list[bool] = []
    out = run_step(scheduler, completes)
    assert scheduled(out) == [("a", 0, 0, 4), ("b", 0, 0, 4), ("c", 0, 0, 2)]
    assert out.num_tokens == 10
    nxt = run_step(scheduler, completes)
    assert scheduled(nxt) == [("a", 0, 4, 1), ("b", 0, 4, 1), ("c", 0, 2, 2)]
    assert completes == [True, True, False, True, True, True]


def test_no_step_exceeds_the_token_budget_or_the_batch_size():
    scheduler = make_scheduler(max_batch_size=3, max_num_tokens=7)
    for index in range(6):
        scheduler.add_request(make_request(str(index), prompt(3 + 2 * index, 100 * index), max_tokens=3,
                                           arrival_time=index))
    outs = run_until_idle(scheduler)
    assert not scheduler.has_work
    assert all(0 < out.num_tokens <= 7 and len(out.scheduled) <= 3 for out in outs)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


# ---------------------------------------------------------------------- chunked prefill


def test_long_prompt_is_prefilled_in_chunks_across_steps():
    scheduler = make_scheduler(max_num_tokens=4)
    request = make_request("a", prompt(10), max_tokens=2)
    scheduler.add_request(request)
    completes: list[bool] = []
    outs = run_until_idle(scheduler, completes=completes)
    assert [scheduled(out) for out in outs] == [
        [("a", 0, 0, 4)], [("a", 0, 4, 4)], [("a", 0, 8, 2)], [("a", 0, 10, 1)],
    ]
    assert completes == [False, False, True, True]
    assert [item.token_ids for item in outs[1].scheduled] == [prompt(10)[4:8]]
    assert request.sequences[0].output_token_ids == [SAMPLED_TOKEN, SAMPLED_TOKEN]


def test_chunk_takes_only_the_blocks_its_tokens_reach():
    scheduler = make_scheduler(max_num_tokens=5)
    request = make_request("a", prompt(12))
    scheduler.add_request(request)
    run_step(scheduler)
    assert len(request.sequences[0].block_ids) == 2
    assert scheduler.kv_cache.num_used_blocks == 2


def test_without_chunked_prefill_a_prompt_waits_until_the_budget_holds_it_whole():
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", prompt(5), max_tokens=2, arrival_time=0))
    scheduler.add_request(make_request("b", prompt(5, 100), max_tokens=2, arrival_time=1))
    outs = run_until_idle(scheduler)
    assert [scheduled(out) for out in outs] == [
        [("a", 0, 0, 5)], [("a", 0, 5, 1), ("b", 0, 0, 5)], [("b", 0, 5, 1)],
    ]


def test_without_chunked_prefill_a_prompt_exactly_filling_the_budget_runs_in_one_step():
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", prompt(8), max_tokens=1))
    assert scheduled(run_step(scheduler)) == [("a", 0, 0, 8)]
    assert not scheduler.has_work


def test_with_chunked_prefill_the_same_prompts_share_the_budget():
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_prefill=True)
    scheduler.add_request(make_request("a", prompt(5), max_tokens=2, arrival_time=0))
    scheduler.add_request(make_request("b", prompt(5, 100), max_tokens=2, arrival_time=1))
    assert scheduled(run_step(scheduler)) == [("a", 0, 0, 5), ("b", 0, 0, 3)]


# ---------------------------------------------------------------------- order


def test_decodes_of_running_requests_are_scheduled_before_new_prefills_even_of_higher_priority():
    scheduler = make_scheduler(max_num_tokens=4)
    scheduler.add_request(make_request("a", prompt(3), priority=0.1, arrival_time=0))
    run_step(scheduler)
    scheduler.add_request(make_request("b", prompt(10, 100), priority=1.0, arrival_time=1))
    out = run_step(scheduler)
    assert [(item.request.request_id, item.num_tokens) for item in out.decodes] == [("a", 1)]
    assert [(item.request.request_id, item.num_tokens) for item in out.prefills] == [("b", 3)]


def test_running_request_mid_prefill_keeps_the_budget_before_new_requests_are_admitted():
    scheduler = make_scheduler(max_num_tokens=4)
    scheduler.add_request(make_request("a", prompt(12), priority=0.1, arrival_time=0))
    run_step(scheduler)
    late = make_request("b", prompt(2, 100), priority=1.0, arrival_time=1)
    scheduler.add_request(late)
    assert scheduled(run_step(scheduler)) == [("a", 0, 4, 4)]
    assert scheduler.waiting == [late]


def test_waiting_requests_are_admitted_by_higher_priority_then_earlier_arrival():
    scheduler = make_scheduler()
    specs = [("late-low", 0.2, 3.0), ("early-mid", 0.5, 0.0), ("late-high", 0.9, 4.0), ("later-mid", 0.5, 2.0),
             ("early-high", 0.9, 1.0)]
    for index, (request_id, priority, arrival) in enumerate(specs):
        scheduler.add_request(make_request(request_id, prompt(3, 100 * index), priority=priority,
                                           arrival_time=arrival))
    expected = ["early-high", "late-high", "early-mid", "later-mid", "late-low"]
    assert [request.request_id for request in scheduler.waiting] == expected
    assert [entry[0] for entry in scheduled(run_step(scheduler))] == expected
    assert [request.request_id for request in scheduler.running] == expected
    assert [entry[0] for entry in scheduled(run_step(scheduler))] == expected


def test_batch_slots_go_to_the_highest_priority_waiting_requests():
    scheduler = make_scheduler(max_batch_size=1)
    scheduler.add_request(make_request("low", prompt(3), max_tokens=1, priority=0.1, arrival_time=0))
    scheduler.add_request(make_request("high", prompt(3, 100), max_tokens=1, priority=0.9, arrival_time=1))
    assert [entry[0] for out in run_until_idle(scheduler) for entry in scheduled(out)] == ["high", "low"]


def test_admission_stops_at_the_first_waiting_request_whose_blocks_do_not_fit():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("running", prompt(8), arrival_time=0))
    run_step(scheduler)
    big = make_request("big", prompt(12, 100), priority=0.9, arrival_time=1)
    small = make_request("small", prompt(3, 200), priority=0.5, arrival_time=2)
    scheduler.add_request(big)
    scheduler.add_request(small)
    out = run_step(scheduler)
    assert scheduled(out) == [("running", 0, 8, 1)]
    assert out.num_preempted == 0
    assert scheduler.waiting == [big, small]
    assert big.sequences[0].block_ids == [] and big.sequences[0].num_computed_tokens == 0


# ---------------------------------------------------------------------- preemption


def _fill_cache_then_add_high_priority(enable_block_reuse: bool = False,
                                       enable_chunked_prefill: bool = True) -> tuple[Scheduler, Request, Request]:
    """4 blocks of 4 tokens: "lo" (8-token prompt) and "hi" (4-token prompt) fill all of them after two
    steps, and hi's next decode needs a fifth block."""
    scheduler = make_scheduler(num_blocks=4, max_num_tokens=8, enable_block_reuse=enable_block_reuse,
                               enable_chunked_prefill=enable_chunked_prefill)
    lo = make_request("lo", prompt(8), max_tokens=4, priority=0.2, arrival_time=0)
    hi = make_request("hi", prompt(4, 100), max_tokens=2, priority=0.9, arrival_time=1)
    scheduler.add_request(lo)
    run_step(scheduler)
    scheduler.add_request(hi)
    assert scheduled(run_step(scheduler)) == [("lo", 0, 8, 1), ("hi", 0, 0, 4)]
    assert scheduler.kv_cache.num_free_blocks == 0
    return scheduler, lo, hi


def test_running_out_of_blocks_preempts_the_lowest_priority_request_and_requeues_it():
    scheduler, lo, hi = _fill_cache_then_add_high_priority()
    out = run_step(scheduler)
    assert out.num_preempted == 1
    assert scheduled(out) == [("hi", 0, 4, 1)]
    assert lo.status == RequestStatus.WAITING
    assert lo.num_preemptions == 1
    assert scheduler.waiting == [lo]
    seq = lo.sequences[0]
    assert (seq.block_ids, seq.num_computed_tokens, seq.num_hashed_blocks) == ([], 0, 0)
    assert seq.token_ids == prompt(8) + [SAMPLED_TOKEN, SAMPLED_TOKEN]  # outputs so far are kept
    assert hi.status == RequestStatus.FINISHED
    assert scheduler.kv_cache.num_free_blocks == 4


def test_preempted_request_is_recomputed_from_scratch_and_completes():
    scheduler, lo, _ = _fill_cache_then_add_high_priority()
    run_step(scheduler)
    completes: list[bool] = []
    outs = run_until_idle(scheduler, completes=completes)
    assert [scheduled(out) for out in outs] == [[("lo", 0, 0, 8)], [("lo", 0, 8, 2)], [("lo", 0, 10, 1)]]
    assert completes == [False, True, True]  # the recompute samples only once it reaches the last token
    assert lo.status == RequestStatus.FINISHED
    assert lo.sequences[0].output_token_ids == [SAMPLED_TOKEN] * 4
    assert scheduler.kv_cache.num_free_blocks == 4


def test_preempted_request_recompute_takes_back_its_cached_prompt_blocks():
    scheduler, lo, _ = _fill_cache_then_add_high_priority(enable_block_reuse=True)
    run_step(scheduler)
    out = run_step(scheduler)
    assert scheduled(out) == [("lo", 0, 4, 6)]  # the first prompt block comes back from the prefix cache
    assert lo.num_preemptions == 1
    run_until_idle(scheduler)
    assert lo.status == RequestStatus.FINISHED


def test_readmission_after_preemption_counts_prefix_misses_again_but_keeps_the_first_num_cached_tokens():
    scheduler, lo, _ = _fill_cache_then_add_high_priority(enable_block_reuse=True)
    assert scheduler.kv_cache.stats()["missedBlocks"] == 3  # lo's two prompt blocks, hi's one
    run_step(scheduler)
    run_step(scheduler)  # lo comes back with its first prompt block from the prefix cache and misses the second
    stats = scheduler.kv_cache.stats()
    assert (stats["reusedBlocks"], stats["missedBlocks"]) == (1, 4)
    assert lo.num_cached_tokens == 0  # what its first admission found


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    scheduler, lo, _ = _fill_cache_then_add_high_priority()
    tiny = make_request("tiny", prompt(2, 300), priority=1.0, arrival_time=2)
    scheduler.add_request(tiny)
    out = run_step(scheduler)
    assert out.num_preempted == 1
    assert [entry[0] for entry in scheduled(out)] == ["hi"]
    assert scheduler.waiting == [tiny, lo]
    assert scheduled(run_step(scheduler)) == [("tiny", 0, 0, 2), ("lo", 0, 0, 6)]


@pytest.mark.parametrize(("priorities", "arrivals"), [((0.9, 0.5, 0.2), (2, 1, 0)), ((0.5, 0.5, 0.5), (0, 1, 2))],
                         ids=["by-priority", "by-arrival"])
def test_preemption_takes_only_the_last_request_in_scheduling_order(priorities, arrivals):
    scheduler = make_scheduler(num_blocks=4)
    first, middle, last = (make_request(request_id, prompt(length, 100 * index), max_tokens=3,
                                        priority=priorities[index], arrival_time=arrivals[index])
                           for index, (request_id, length) in enumerate([("first", 4), ("middle", 3), ("last", 6)]))
    for request in (last, middle, first):
        scheduler.add_request(request)
    assert [entry[0] for entry in scheduled(run_step(scheduler))] == ["first", "middle", "last"]
    assert scheduler.kv_cache.num_free_blocks == 0
    out = run_step(scheduler)  # first's decode needs a block; middle's fits in its own
    assert out.num_preempted == 1
    assert [entry[0] for entry in scheduled(out)] == ["first", "middle"]
    assert (first.status, middle.status, last.status) == (RequestStatus.RUNNING, RequestStatus.RUNNING,
                                                          RequestStatus.WAITING)
    run_until_idle(scheduler)
    assert all(request.status == RequestStatus.FINISHED for request in (first, middle, last))


def test_request_short_of_blocks_preempts_itself_when_it_is_last_in_scheduling_order():
    scheduler = make_scheduler(num_blocks=3)
    hi = make_request("hi", prompt(3), max_tokens=2, priority=0.9, arrival_time=0)
    lo = make_request("lo", prompt(8, 100), max_tokens=2, priority=0.2, arrival_time=1)
    scheduler.add_request(hi)
    scheduler.add_request(lo)
    run_step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 0
    out = run_step(scheduler)
    assert out.num_preempted == 1
    assert scheduled(out) == [("hi", 0, 3, 1)]
    assert (hi.status, lo.status) == (RequestStatus.FINISHED, RequestStatus.WAITING)
    run_until_idle(scheduler)
    assert lo.status == RequestStatus.FINISHED


def test_preempted_request_resumes_without_chunked_prefill_after_outgrowing_the_token_budget():
    scheduler, lo, _ = _fill_cache_then_add_high_priority(enable_chunked_prefill=False)
    assert run_step(scheduler).num_preempted == 1
    assert lo.sequences[0].num_tokens == 10  # the 8-token prompt fitted max_num_tokens=8; prompt + outputs do not
    run_until_idle(scheduler)
    assert lo.status == RequestStatus.FINISHED


# ---------------------------------------------------------------------- prefix cache


def test_prefix_cache_hit_schedules_only_the_uncached_tail_of_the_prompt():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt(9), max_tokens=1))
    run_until_idle(scheduler)
    again = make_request("b", prompt(9), max_tokens=1)
    scheduler.add_request(again)
    completes: list[bool] = []
    out = run_step(scheduler, completes)
    assert scheduled(out) == [("b", 0, 8, 1)]
    assert completes == [True]
    assert again.num_cached_tokens == 8
    stats = scheduler.kv_cache.stats()
    assert (stats["reusedBlocks"], stats["missedBlocks"], stats["cacheHitRate"]) == (2, 2, 0.5)


def test_prefix_cache_hit_lets_a_long_prompt_finish_prefill_within_one_budget():
    cached = make_scheduler(max_num_tokens=5)
    cached.add_request(make_request("a", prompt(9), max_tokens=1))
    run_until_idle(cached)
    cached.add_request(make_request("b", prompt(13), max_tokens=1))
    assert scheduled(run_step(cached)) == [("b", 0, 8, 5)]

    uncached = make_scheduler(max_num_tokens=5, enable_block_reuse=False)
    uncached.add_request(make_request("a", prompt(9), max_tokens=1))
    run_until_idle(uncached)
    uncached.add_request(make_request("b", prompt(13), max_tokens=1))
    assert scheduled(run_step(uncached)) == [("b", 0, 0, 5)]


def test_prefix_hit_on_a_running_request_shares_its_blocks():
    scheduler = make_scheduler()
    owner = make_request("a", prompt(9), max_tokens=4, arrival_time=0)
    scheduler.add_request(owner)
    run_step(scheduler)
    sharer = make_request("b", prompt(9), max_tokens=4, arrival_time=1)
    scheduler.add_request(sharer)
    out = run_step(scheduler)
    assert scheduled(out) == [("a", 0, 9, 1), ("b", 0, 8, 1)]
    assert sharer.sequences[0].block_ids[:2] == owner.sequences[0].block_ids[:2]
    assert sharer.sequences[0].block_ids[2] != owner.sequences[0].block_ids[2]
    assert [scheduler.kv_cache.blocks[i].ref_count for i in owner.sequences[0].block_ids[:2]] == [2, 2]


def test_requests_admitted_in_the_same_step_do_not_hit_each_others_uncomputed_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt(9), arrival_time=0))
    scheduler.add_request(make_request("b", prompt(9), arrival_time=1))
    assert scheduled(run_step(scheduler)) == [("a", 0, 0, 9), ("b", 0, 0, 9)]


@pytest.mark.parametrize("case", ["reuse-off", "prompt-logprobs", "other-salt"])
def test_no_prefix_hit_when_reuse_is_off_prompt_logprobs_are_wanted_or_the_salt_differs(case):
    scheduler = make_scheduler(enable_block_reuse=case != "reuse-off")
    scheduler.add_request(make_request("a", prompt(9), max_tokens=1, cache_salt="one"))
    run_until_idle(scheduler)
    again = make_request("b", prompt(9), max_tokens=1, cache_salt="two" if case == "other-salt" else "one",
                         prompt_logprobs=0 if case == "prompt-logprobs" else None)
    scheduler.add_request(again)
    assert scheduled(run_step(scheduler)) == [("b", 0, 0, 9)]
    assert again.num_cached_tokens == 0


# ---------------------------------------------------------------------- forked sequences


def test_forked_sequences_copy_their_shared_partial_block_on_the_first_decode():
    scheduler = make_scheduler()
    request = make_request("a", prompt(5), max_tokens=3, n=2)
    scheduler.add_request(request)
    run_step(scheduler)
    parent, child = request.sequences
    shared = list(parent.block_ids)
    assert child.block_ids == shared
    out = run_step(scheduler)
    assert scheduled(out) == [("a", 0, 5, 1), ("a", 1, 5, 1)]
    assert out.block_copies == [(shared[1], parent.block_ids[1])]
    assert parent.block_ids[0] == child.block_ids[0] == shared[0]
    assert child.block_ids[1] == shared[1] != parent.block_ids[1]
    assert run_step(scheduler).block_copies == []
    run_until_idle(scheduler)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_forked_siblings_sharing_a_partial_block_decode_without_preemption_when_one_copy_fits():
    scheduler = make_scheduler(num_blocks=4)
    forked = make_request("forked", prompt(5), max_tokens=3, n=2, priority=0.9, arrival_time=0)
    other = make_request("other", prompt(3, 100), max_tokens=3, priority=0.2, arrival_time=1)
    scheduler.add_request(forked)
    scheduler.add_request(other)
    run_step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 1  # enough for the one copy the two siblings need
    out = run_step(scheduler)
    assert out.num_preempted == 0
    assert scheduled(out) == [("forked", 0, 5, 1), ("forked", 1, 5, 1), ("other", 0, 3, 1)]


def test_preempted_forked_request_longer_than_the_token_budget_is_recomputed_and_completes():
    scheduler = make_scheduler(num_blocks=9, max_num_tokens=8)
    forked = make_request("forked", prompt(10), max_tokens=4, n=2, priority=0.2, arrival_time=0)
    scheduler.add_request(forked)
    run_step(scheduler)
    run_step(scheduler)
    assert len(forked.sequences) == 2
    hi = make_request("hi", prompt(20, 100), max_tokens=4, priority=0.9, arrival_time=1)
    scheduler.add_request(hi)
    outs = run_until_idle(scheduler, max_steps=4)
    assert [out.num_preempted for out in outs] == [0, 0, 0, 1]
    assert forked.status == RequestStatus.WAITING
    # Each sequence needs 13 tokens recomputed, more than max_num_tokens=8: 8 blocks in all, which the cache
    # holds once hi is done.
    assert [seq.num_tokens for seq in forked.sequences] == [13, 13]
    run_until_idle(scheduler, max_steps=60)
    assert hi.status == RequestStatus.FINISHED
    assert forked.status == RequestStatus.FINISHED


def test_a_pipeline_keeps_sequences_whose_draw_is_in_flight_out_of_the_next_step():
    """skip_in_flight (pipelines overlapping steps): a sequence holding a placeholder waits; one still in
    prefill, or whose draw has arrived, is scheduled; waiting requests are admitted beside them."""
    from raylm.engine.request import PLACEHOLDER

    scheduler = make_scheduler(max_num_tokens=64)
    scheduler.skip_in_flight = True
    drawing, chunking = make_request("drawing", prompt(5)), make_request("chunking", prompt(80, 100))
    for request in (drawing, chunking):
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert [(i.request.request_id, i.num_tokens) for i in first.scheduled] == [("drawing", 5), ("chunking", 59)]
    for item in first.scheduled:  # as Progress.launched does with placeholders
        item.seq.num_computed_tokens += item.num_tokens
        if item.completes:
            item.seq.token_ids.append(PLACEHOLDER)
    scheduler.add_request(make_request("new", prompt(3, 300)))
    second = scheduler.schedule()
    assert [(i.request.request_id, i.num_tokens) for i in second.scheduled] == [("chunking", 21), ("new", 3)]
    drawing.sequences[0].token_ids[-1] = SAMPLED_TOKEN  # its draw arrived
    assert "drawing" in [i.request.request_id for i in scheduler.schedule().scheduled]


def test_a_pipeline_readmits_a_preempted_request_only_once_its_draw_arrived():
    """A request preempted while its draw is in flight goes back to the queue with a placeholder; a pipeline
    (skip_in_flight) admits it again only once the draw has replaced it."""
    from raylm.engine.request import PLACEHOLDER

    scheduler = make_scheduler(max_num_tokens=64)
    scheduler.skip_in_flight = True
    request = make_request("preempted", prompt(5))
    scheduler.add_request(request)
    item = scheduler.schedule().scheduled[0]
    item.seq.num_computed_tokens += item.num_tokens
    item.seq.token_ids.append(PLACEHOLDER)
    scheduler.preempt(request)
    assert scheduler.schedule().is_empty
    item.seq.token_ids[-1] = SAMPLED_TOKEN
    assert [(i.request.request_id, i.num_tokens) for i in scheduler.schedule().scheduled] == [("preempted", 6)]


# ---------------------------------------------------------------------- capacity policy


def test_guaranteed_no_evict_admits_only_what_can_run_to_the_end():
    """Four requests of 8 prompt + 24 output tokens (8 blocks of 4 each at most) over 20 blocks: MAX_UTILIZATION
    admits them all and preempts as their decodes grow; GUARANTEED_NO_EVICT admits two, then the others as the
    first finish, and never preempts. Both finish every request."""
    outcomes = {}
    for guarantee in (False, True):
        scheduler = make_scheduler(num_blocks=20)
        scheduler.guarantee_no_evict = guarantee
        for index in range(4):
            scheduler.add_request(make_request(f"r{index}", prompt(8, 100 * index), max_tokens=24,
                                               arrival_time=index))
        first = run_step(scheduler)
        outs = [first, *run_until_idle(scheduler, max_steps=200)]
        outcomes[guarantee] = (len({item.request.request_id for item in first.scheduled}),
                               sum(out.num_preempted for out in outs), scheduler.has_work)
    assert outcomes[False][0] == 4 and outcomes[False][1] > 0 and not outcomes[False][2]
    assert outcomes[True] == (2, 0, False)


def test_guaranteed_no_evict_still_runs_a_request_larger_than_the_cache_alone():
    scheduler = make_scheduler(num_blocks=4)
    scheduler.guarantee_no_evict = True
    scheduler.add_request(make_request("big", prompt(8), max_tokens=24))
    assert scheduled(run_step(scheduler)) == [("big", 0, 0, 8)]
