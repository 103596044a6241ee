"""KVCacheManager: the block pool, sharing and copy-on-write, eviction order, the prefix cache, stats, events."""

from __future__ import annotations

import pytest

from raylm.engine.kv_cache import NULL_BLOCK, KVCacheManager, hash_block
from raylm.engine.request import Request, Sequence
from raylm.sampling_params import SamplingParams

BLOCK = 4


def make_request(tokens: list[int], request_id: str = "r", cache_salt: str | None = None,
                 prompt_logprobs: int | None = None) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens), cache_salt=cache_salt,
                   sampling_params=SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs))


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None,
            seq: Sequence | None = None) -> Sequence:
    """Allocates and 'computes' num_tokens more tokens of seq (all uncomputed ones by default), as a step does."""
    seq = seq or request.sequences[0]
    num_tokens = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
    assert kv.allocate(request, seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    kv.register_full_blocks(request, seq)
    return seq


def fork(kv: KVCacheManager, parent: Sequence) -> Sequence:
    child = parent.fork(1, None)
    kv.fork(parent, child)
    return child


def allocation_order(kv: KVCacheManager, num_blocks: int) -> list[int]:
    """The block ids the pool hands out next, in order (taken by a fresh sequence)."""
    request = make_request(list(range(900, 900 + num_blocks * BLOCK)), request_id="probe")
    seq = request.sequences[0]
    assert kv.allocate(request, seq, num_blocks * BLOCK)
    return seq.block_ids


def event_types(events: list[dict]) -> list[str]:
    return [event["data"]["type"] for event in events]


# ---------------------------------------------------------------------- block pool


def test_cache_with_no_blocks_is_rejected():
    with pytest.raises(ValueError, match="at least one block, got 0"):
        KVCacheManager(0, BLOCK, enable_block_reuse=True)


def test_new_cache_reports_every_block_free_and_zero_counters():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    assert kv.stats() == {
        "maxNumBlocks": 6, "freeNumBlocks": 6, "usedNumBlocks": 0, "tokensPerBlock": BLOCK,
        "allocTotalBlocks": 0, "allocNewBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0, "cacheHitRate": 0.0,
    }


def test_allocate_gives_ceil_of_tokens_over_block_size_blocks_in_pool_order():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(9)))
    seq = request.sequences[0]
    assert kv.allocate(request, seq, 9)
    assert seq.block_ids == [1, 2, 3]
    assert [kv.blocks[i].ref_count for i in range(1, 7)] == [1, 1, 1, 0, 0, 0]
    assert (kv.num_free_blocks, kv.num_used_blocks) == (3, 3)
    assert seq.num_computed_tokens == 0  # allocation reserves space; computing is the caller's business


def test_allocate_adds_a_block_only_when_tokens_cross_a_block_boundary():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(9)))
    seq = compute(kv, request)
    seq.token_ids += [100, 101, 102, 103]
    assert kv.allocate(request, seq, 3)  # positions 9..11 still fit in block 3
    assert seq.block_ids == [1, 2, 3]
    seq.num_computed_tokens += 3
    assert kv.allocate(request, seq, 1)  # position 12 opens block 4
    assert seq.block_ids == [1, 2, 3, 4]


def test_allocate_that_does_not_fit_returns_false_and_changes_nothing():
    kv = KVCacheManager(3, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(13)))
    seq = request.sequences[0]
    assert not kv.allocate(request, seq, 13)
    assert seq.block_ids == []
    assert kv.num_free_blocks == 3
    assert kv.stats()["allocTotalBlocks"] == 0
    assert kv.allocate(request, seq, 12)  # exactly the pool fits
    assert kv.num_free_blocks == 0


def test_null_block_is_never_handed_out_even_when_the_pool_is_used_up_and_recycled():
    kv = KVCacheManager(3, BLOCK, enable_block_reuse=True)
    assert kv.stats()["maxNumBlocks"] == 3  # the null block is not counted
    for index in range(3):  # each round evicts the blocks the previous one left cached
        request = make_request(list(range(100 * index, 100 * index + 12)), request_id=str(index))
        seq = compute(kv, request)
        assert sorted(seq.block_ids) == [1, 2, 3]
        assert (kv.num_free_blocks, kv.num_used_blocks) == (0, 3)
        seq.token_ids.append(99)
        assert not kv.allocate(request, seq, 1)  # a full pool says no rather than fall back to the null block
        kv.free(seq)
    request = make_request(list(range(5)), request_id="cow")
    parent = compute(kv, request)
    child = fork(kv, parent)
    parent.token_ids.append(99)
    assert kv.allocate(request, parent, 1)  # the copy of the shared partial block takes the last free block
    assert sorted(set(parent.block_ids + child.block_ids)) == [1, 2, 3]
    assert kv.num_free_blocks == 0
    assert NULL_BLOCK not in kv.free_queue
    assert (kv.blocks[NULL_BLOCK].ref_count, kv.blocks[NULL_BLOCK].block_hash) == (0, None)


@pytest.mark.parametrize(("computed", "new", "expected"), [
    (0, 1, 1), (0, 4, 1), (0, 5, 2), (0, 9, 3), (3, 1, 0), (3, 2, 1), (4, 1, 1), (4, 4, 1), (8, 0, 0),
])
def test_blocks_needed_counts_blocks_beyond_the_sequences_table(computed, new, expected):
    kv = KVCacheManager(10, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(20)))
    if computed:
        compute(kv, request, computed)
    assert kv.blocks_needed(request.sequences[0], new) == expected


# ---------------------------------------------------------------------- fork and copy-on-write


def test_fork_shares_every_block_by_reference_count_without_taking_blocks():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    parent = compute(kv, make_request(list(range(6))))
    child = fork(kv, parent)
    assert child.block_ids == parent.block_ids == [1, 2]
    assert child.block_ids is not parent.block_ids
    assert [kv.blocks[i].ref_count for i in (1, 2)] == [2, 2]
    assert kv.num_free_blocks == 4


def test_first_write_into_a_shared_partial_last_block_copies_it():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(5)))
    parent = compute(kv, request)
    child = fork(kv, parent)
    parent.token_ids.append(100)
    assert kv.blocks_needed(parent, 1) == 1
    assert kv.allocate(request, parent, 1)
    assert parent.block_ids == [1, 3]
    assert child.block_ids == [1, 2]
    assert kv.pending_copies == [(2, 3)]
    assert [kv.blocks[i].ref_count for i in (1, 2, 3)] == [2, 1, 1]
    assert kv.take_pending_copies() == [(2, 3)]
    assert kv.take_pending_copies() == []
    assert kv.stats()["allocNewBlocks"] == 3  # two for the prompt, one for the copy


def test_last_sharer_of_a_partial_block_writes_in_place_after_the_others_copied():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(5)))
    parent = compute(kv, request)
    child = fork(kv, parent)
    assert kv.allocate(request, parent, 1)
    kv.take_pending_copies()
    assert kv.blocks_needed(child, 1) == 0
    assert kv.allocate(request, child, 1)
    assert child.block_ids == [1, 2]
    assert kv.pending_copies == []


def test_write_after_a_shared_full_last_block_takes_a_new_block_and_no_copy():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(8)))
    parent = compute(kv, request)
    fork(kv, parent)
    parent.token_ids.append(100)
    assert kv.blocks_needed(parent, 1) == 1
    assert kv.allocate(request, parent, 1)
    assert parent.block_ids == [1, 2, 3]
    assert kv.pending_copies == []
    assert [kv.blocks[i].ref_count for i in (1, 2, 3)] == [2, 2, 1]


def test_copy_on_write_that_does_not_fit_returns_false():
    kv = KVCacheManager(2, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(5)))
    parent = compute(kv, request)
    fork(kv, parent)
    assert not kv.allocate(request, parent, 1)
    assert parent.block_ids == [1, 2]
    assert kv.pending_copies == []


@pytest.mark.parametrize("num_new_tokens", [1, 4], ids=["within-the-block", "into-a-new-block"])
@pytest.mark.parametrize(("num_sharers", "num_writers", "num_copies"),
                         [(2, 2, 1), (3, 3, 2), (4, 4, 3), (2, 1, 1), (3, 1, 1), (3, 2, 2), (4, 3, 3)])
def test_blocks_needed_for_counts_one_copy_fewer_than_the_sharers_only_when_all_of_them_write(
        num_sharers, num_writers, num_copies, num_new_tokens):
    kv = KVCacheManager(16, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(5)))
    parent = compute(kv, request)  # its second block holds one token: partial, and shared by every fork
    sharers = [parent] + [parent.fork(index, None) for index in range(1, num_sharers)]
    for child in sharers[1:]:
        kv.fork(parent, child)
    writers = sharers[:num_writers]
    for seq in writers:
        seq.token_ids += [100] * num_new_tokens
    new_blocks_each = 1 if num_new_tokens == 4 else 0  # positions 5..8 reach a third block
    expected = num_copies + num_writers * new_blocks_each
    plan = [(seq, num_new_tokens) for seq in writers]
    assert kv.blocks_needed_for(plan) == expected
    free_before = kv.num_free_blocks
    for seq, tokens in plan:
        assert kv.allocate(request, seq, tokens)
    assert free_before - kv.num_free_blocks == expected  # what the plan takes, no more
    assert len(kv.take_pending_copies()) == num_copies


def test_shared_block_returns_to_the_pool_only_when_its_last_sharer_frees_it():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    parent = compute(kv, make_request(list(range(6))))
    child = fork(kv, parent)
    kv.free(child)
    assert child.block_ids == []
    assert kv.num_free_blocks == 4
    assert [kv.blocks[i].ref_count for i in (1, 2)] == [1, 1]
    kv.free(parent)
    assert kv.num_free_blocks == 6
    assert [kv.blocks[i].ref_count for i in (1, 2)] == [0, 0]


# ---------------------------------------------------------------------- free order and eviction


def test_freed_sequence_gives_back_its_last_block_first():
    kv = KVCacheManager(3, BLOCK, enable_block_reuse=False)
    seq = compute(kv, make_request(list(range(12))))
    assert seq.block_ids == [1, 2, 3]
    kv.free(seq)
    assert allocation_order(kv, 3) == [3, 2, 1]


def test_freed_blocks_are_reused_least_recently_freed_first():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=False)
    first = compute(kv, make_request(list(range(8)), request_id="a"))
    second = compute(kv, make_request(list(range(8)), request_id="b"))
    assert (first.block_ids, second.block_ids) == ([1, 2], [3, 4])
    kv.free(second)
    kv.free(first)
    assert allocation_order(kv, 4) == [4, 3, 2, 1]


def test_never_used_blocks_are_handed_out_before_cached_free_blocks():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=True)
    cached = make_request(list(range(9)), request_id="a")
    kv.free(compute(kv, cached))
    assert allocation_order(kv, 1) == [4]
    assert [block.block_id for block in kv.match_prefix(make_request(list(range(9)), request_id="b"))] == [1, 2]


def test_eviction_takes_the_last_cached_block_of_a_prefix_first():
    kv = KVCacheManager(3, BLOCK, enable_block_reuse=True)
    kv.free(compute(kv, make_request(list(range(12)), request_id="a")))
    assert len(kv.cached) == 3
    assert allocation_order(kv, 1) == [3]
    hits = kv.match_prefix(make_request(list(range(13)), request_id="b"))
    assert [block.block_id for block in hits] == [1, 2]


def test_evicting_a_cached_block_forgets_its_hash():
    kv = KVCacheManager(2, BLOCK, enable_block_reuse=True)
    kv.free(compute(kv, make_request(list(range(8)), request_id="a")))
    allocation_order(kv, 2)
    assert kv.cached == {}
    assert all(block.block_hash is None for block in kv.blocks)
    assert kv.match_prefix(make_request(list(range(9)), request_id="b")) == []


# ---------------------------------------------------------------------- prefix cache


def test_hash_block_is_stable_and_depends_on_parent_tokens_and_salt():
    base = hash_block(None, [1, 2, 3, 4], None)
    assert base == hash_block(None, [1, 2, 3, 4], None)
    assert 0 <= base < 2**64
    variants = {
        hash_block(123, [1, 2, 3, 4], None),
        hash_block(None, [1, 2, 3, 5], None),
        hash_block(None, [1, 2, 3, 4], "salt"),
        hash_block(None, [1, 2, 3, 4], "other"),
    }
    assert base not in variants
    assert len(variants) == 4


def test_register_full_blocks_keys_only_blocks_filled_by_computed_tokens():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request(list(range(10)))
    seq = request.sequences[0]
    assert kv.allocate(request, seq, 10)
    seq.num_computed_tokens = 7
    kv.register_full_blocks(request, seq)
    assert seq.num_hashed_blocks == 1
    assert [kv.blocks[i].block_hash is not None for i in seq.block_ids] == [True, False, False]
    seq.num_computed_tokens = 10
    kv.register_full_blocks(request, seq)
    assert seq.num_hashed_blocks == 2
    assert len(kv.cached) == 2


def test_registered_hashes_chain_over_every_earlier_token_like_prompt_block_hashes():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    tokens = list(range(10, 22))
    request = make_request(tokens, cache_salt="s")
    seq = compute(kv, request, 5)
    compute(kv, request, 7)  # two chunks: the chain continues from the cursor the first chunk left
    first = hash_block(None, tokens[0:4], "s")
    second = hash_block(first, tokens[4:8], "s")
    third = hash_block(second, tokens[8:12], "s")
    assert [kv.blocks[i].block_hash for i in seq.block_ids] == [first, second, third]
    assert kv.prompt_block_hashes(request) == [first, second, third]
    assert seq.last_block_hash == third
    assert kv.cached == {first: kv.blocks[1], second: kv.blocks[2], third: kv.blocks[3]}


def test_register_full_blocks_keys_generated_tokens_too():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    request = make_request([1, 2, 3, 4, 5, 6])
    seq = compute(kv, request)
    seq.token_ids += [7, 8]
    compute(kv, request, 2, seq)
    assert kv.blocks[seq.block_ids[1]].block_hash == hash_block(hash_block(None, [1, 2, 3, 4], None), [5, 6, 7, 8],
                                                                None)


def test_register_full_blocks_keys_nothing_when_block_reuse_is_off():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=False)
    seq = compute(kv, make_request(list(range(9))))
    assert kv.cached == {}
    assert seq.num_hashed_blocks == 0
    assert all(block.block_hash is None for block in kv.blocks)


def test_duplicate_block_computed_twice_keeps_the_first_as_the_cached_copy():
    kv = KVCacheManager(6, BLOCK, enable_block_reuse=True)
    first = compute(kv, make_request(list(range(5)), request_id="a"))
    second = compute(kv, make_request(list(range(5)), request_id="b"))
    assert kv.cached == {kv.blocks[first.block_ids[0]].block_hash: kv.blocks[first.block_ids[0]]}
    assert kv.blocks[second.block_ids[0]].block_hash is None
    assert second.last_block_hash == first.last_block_hash  # the chain still continues through the duplicate
    kv.free(second)
    hits = kv.match_prefix(make_request(list(range(5)), request_id="c"))
    assert [block.block_id for block in hits] == [first.block_ids[0]]


def test_match_prefix_returns_the_longest_run_of_cached_blocks():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    cached = compute(kv, make_request(list(range(13)), request_id="a"))
    request = make_request(list(range(8)) + [99, 98, 97, 96, 95], request_id="b")
    hits = kv.match_prefix(request)
    assert [block.block_id for block in hits] == cached.block_ids[:2]
    assert request.prompt_block_hashes == kv.prompt_block_hashes(request)


@pytest.mark.parametrize(("prompt_len", "num_hits"), [(4, 0), (5, 1), (8, 1), (9, 2), (12, 2), (13, 3)])
def test_match_prefix_leaves_at_least_one_prompt_token_to_compute(prompt_len, num_hits):
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    compute(kv, make_request(list(range(16)), request_id="a"))
    hits = kv.match_prefix(make_request(list(range(prompt_len)), request_id="b"))
    assert len(hits) == num_hits
    assert prompt_len - len(hits) * BLOCK >= 1


def test_match_prefix_stops_at_the_first_block_that_differs_even_if_later_tokens_agree():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    compute(kv, make_request(list(range(13)), request_id="a"))
    tokens = list(range(13))
    tokens[5] = 500
    assert [block.block_id for block in kv.match_prefix(make_request(tokens, request_id="b"))] == [1]
    tokens[1] = 100
    assert kv.match_prefix(make_request(tokens, request_id="c")) == []


def test_match_prefix_finds_nothing_when_block_reuse_is_off():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=False)
    compute(kv, make_request(list(range(9)), request_id="a"))
    assert kv.match_prefix(make_request(list(range(9)), request_id="b")) == []


def test_match_prefix_finds_nothing_for_a_request_that_wants_prompt_logprobs():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    compute(kv, make_request(list(range(9)), request_id="a"))
    assert len(kv.match_prefix(make_request(list(range(9)), request_id="b"))) == 2
    assert kv.match_prefix(make_request(list(range(9)), request_id="c", prompt_logprobs=0)) == []


def test_cache_salt_separates_identical_prompts():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    compute(kv, make_request(list(range(9)), request_id="a", cache_salt="alice"))
    assert kv.match_prefix(make_request(list(range(9)), request_id="b", cache_salt="bob")) == []
    assert kv.match_prefix(make_request(list(range(9)), request_id="c")) == []
    assert len(kv.match_prefix(make_request(list(range(9)), request_id="d", cache_salt="alice"))) == 2


def test_allocate_with_prefix_hits_starts_the_table_with_them_and_skips_their_tokens():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    cached = compute(kv, make_request(list(range(9)), request_id="a"))
    cached_ids = list(cached.block_ids)
    kv.free(cached)
    request = make_request(list(range(11)), request_id="b")
    hits = kv.match_prefix(request)
    seq = request.sequences[0]
    assert kv.allocate(request, seq, 3, prefix_hits=hits)
    assert seq.block_ids[:2] == cached_ids[:2]
    assert len(seq.block_ids) == 3
    assert seq.num_computed_tokens == 8
    assert seq.num_hashed_blocks == 2
    assert seq.last_block_hash == hits[-1].block_hash
    assert [kv.blocks[i].ref_count for i in seq.block_ids] == [1, 1, 1]
    assert kv.num_used_blocks == 3
    stats = kv.stats()
    assert (stats["reusedBlocks"], stats["allocTotalBlocks"], stats["allocNewBlocks"]) == (2, 6, 4)


def test_prefix_hit_on_a_block_in_use_shares_it_by_reference_count():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    owner = compute(kv, make_request(list(range(9)), request_id="a"))
    owner_ids = list(owner.block_ids)
    request = make_request(list(range(9)), request_id="b")
    hits = kv.match_prefix(request)
    assert kv.allocate(request, request.sequences[0], 1, prefix_hits=hits)
    assert request.sequences[0].block_ids[:2] == owner_ids[:2]
    assert [kv.blocks[i].ref_count for i in owner_ids] == [2, 2, 1]
    assert kv.num_used_blocks == 4
    kv.free(owner)
    assert [kv.blocks[i].ref_count for i in owner_ids] == [1, 1, 0]


def test_allocate_counts_evictable_prefix_hits_against_the_free_pool():
    kv = KVCacheManager(3, BLOCK, enable_block_reuse=True)
    kv.free(compute(kv, make_request(list(range(8)) + [50], request_id="a")))
    too_long = make_request(list(range(13)), request_id="b")
    hits = kv.match_prefix(too_long)
    assert len(hits) == 2
    assert not kv.allocate(too_long, too_long.sequences[0], 5, prefix_hits=hits)  # 2 hits + 2 new > 3 blocks
    assert too_long.sequences[0].block_ids == []
    assert (kv.num_free_blocks, len(kv.cached), kv.stats()["reusedBlocks"]) == (3, 2, 0)
    fits = make_request(list(range(9)), request_id="c")
    assert kv.allocate(fits, fits.sequences[0], 1, prefix_hits=kv.match_prefix(fits))  # 2 hits + 1 new == 3
    assert kv.num_free_blocks == 0


# ---------------------------------------------------------------------- statistics


def test_stats_count_reused_and_missed_blocks_and_the_hit_rate():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    first = make_request(list(range(9)), request_id="a")
    kv.count_prefix_misses(first, 0)
    kv.free(compute(kv, first))
    second = make_request(list(range(9)), request_id="b")
    hits = kv.match_prefix(second)
    kv.count_prefix_misses(second, len(hits))
    assert kv.allocate(second, second.sequences[0], 1, prefix_hits=hits)
    assert kv.stats() == {
        "maxNumBlocks": 8, "freeNumBlocks": 5, "usedNumBlocks": 3, "tokensPerBlock": BLOCK,
        "allocTotalBlocks": 6, "allocNewBlocks": 4, "reusedBlocks": 2, "missedBlocks": 2, "cacheHitRate": 0.5,
    }


def test_prefix_misses_are_not_counted_when_reuse_is_off_or_prompt_logprobs_are_wanted():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=False)
    kv.count_prefix_misses(make_request(list(range(9))), 0)
    assert kv.stats()["missedBlocks"] == 0
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True)
    kv.count_prefix_misses(make_request(list(range(9)), prompt_logprobs=1), 0)
    assert kv.stats()["missedBlocks"] == 0
    kv.count_prefix_misses(make_request(list(range(9))), 1)
    assert kv.stats()["missedBlocks"] == 1


# ---------------------------------------------------------------------- events


def test_events_are_off_by_default():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=True)
    kv.free(compute(kv, make_request(list(range(8)))))
    allocation_order(kv, 4)
    assert kv.events is None
    assert kv.take_events() == []


def test_created_event_reports_the_pool_size():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=True, event_buffer_max_size=10)
    assert kv.take_events() == [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [4]}, "window_size": BLOCK},
    ]
    assert kv.take_events() == []


def test_stored_events_list_new_full_blocks_chained_on_their_parent():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=True, event_buffer_max_size=10)
    kv.take_events()
    tokens = list(range(10, 22))
    request = make_request(tokens)
    compute(kv, request, 5)
    compute(kv, request, 7)
    first, second, third = kv.prompt_block_hashes(request)
    assert kv.take_events() == [
        {"event_id": 1, "window_size": BLOCK, "data": {"type": "stored", "parent_hash": None, "blocks": [
            {"type": "stored_block", "block_hash": first, "tokens": tokens[0:4]}]}},
        {"event_id": 2, "window_size": BLOCK, "data": {"type": "stored", "parent_hash": first, "blocks": [
            {"type": "stored_block", "block_hash": second, "tokens": tokens[4:8]},
            {"type": "stored_block", "block_hash": third, "tokens": tokens[8:12]}]}},
    ]


def test_no_stored_event_for_a_block_already_cached():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=True, event_buffer_max_size=10)
    compute(kv, make_request(list(range(5)), request_id="a"))
    kv.take_events()
    compute(kv, make_request(list(range(5)), request_id="b"))
    assert kv.take_events() == []


def test_evicting_a_cached_block_emits_a_removed_event_with_its_hash():
    kv = KVCacheManager(2, BLOCK, enable_block_reuse=True, event_buffer_max_size=10)
    request = make_request(list(range(8)))
    kv.free(compute(kv, request))
    first, second = kv.prompt_block_hashes(request)
    kv.take_events()
    allocation_order(kv, 2)
    events = kv.take_events()
    assert [event["data"] for event in events] == [
        {"type": "removed", "block_hashes": [second]},
        {"type": "removed", "block_hashes": [first]},
    ]
    assert [event["event_id"] for event in events] == [2, 3]  # created, stored, then the removals


def test_allocating_never_cached_blocks_emits_no_removed_event():
    kv = KVCacheManager(4, BLOCK, enable_block_reuse=True, event_buffer_max_size=10)
    kv.take_events()
    allocation_order(kv, 4)
    assert kv.take_events() == []


def test_event_buffer_keeps_only_the_newest_events():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True, event_buffer_max_size=2)
    for index in range(3):
        compute(kv, make_request([index * 10 + t for t in range(4)], request_id=str(index)))
    events = kv.take_events()
    assert event_types(events) == ["stored", "stored"]
    assert [event["event_id"] for event in events] == [2, 3]


def test_stored_event_parent_is_the_block_before_the_first_stored_block():
    kv = KVCacheManager(8, BLOCK, enable_block_reuse=True, event_buffer_max_size=10)
    compute(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8], request_id="a"))
    kv.take_events()
    # Admitted in the same step as "a", so it computed its own copy of the shared first block.
    request = make_request([1, 2, 3, 4, 50, 60, 70, 80], request_id="b")
    compute(kv, request)
    shared, own = kv.prompt_block_hashes(request)
    [event] = kv.take_events()
    assert event["data"]["blocks"] == [{"type": "stored_block", "block_hash": own, "tokens": [50, 60, 70, 80]}]
    assert event["data"]["parent_hash"] == shared
