"""The prefix-aware request router in this process, through the hooks Ray Serve calls (choose_replicas,
on_request_routed, update_replicas), over stand-in replicas: block chains, affinity to the replica that took a
prefix, the load bound, rendezvous placement that separate routers agree on, and the table's capacity."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from raylm.inputs import TokensPrompt
from raylm.sampling_params import SamplingParams
from raylm.serving.prefix_router import PrefixAwareRouter, RoutedPrefixes, prompt_block_chain

DEPLOYMENT = DeploymentID(name="RaylmEngine", app_name="raylm")
BLOCK = 4
_request_ids = itertools.count()


class StandInReplica:
    """What a router reads of a replica: its id, routing stats, queue bound and queue length."""

    def __init__(self, name: str, kv_cache_tokens: int | None = None):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats = {"kv_cache_tokens": kv_cache_tokens} if kv_cache_tokens else {}
        self.max_ongoing_requests = 100
        self.queue_len = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _router(replicas: list[StandInReplica], max_imbalance: int = 2) -> PrefixAwareRouter:
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                               use_replica_queue_len_cache=True)
    router.initialize_state(block_size=BLOCK, max_imbalance=max_imbalance)
    router.update_replicas(replicas)
    return router


def _request(token_ids: list[int], method: str = "stream", salt: str | None = None) -> PendingRequest:
    request_id = str(next(_request_ids))
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id, call_method=method)
    args = [TokensPrompt(prompt_token_ids=token_ids), SamplingParams(max_tokens=1), 0.0, salt]
    return PendingRequest(args=args, kwargs={}, metadata=metadata)


async def _route(router: PrefixAwareRouter, replicas: list[StandInReplica], request: PendingRequest) -> str:
    """What Serve does: the first rank's replica with the shortest queue takes the request."""
    ranks = await router.choose_replicas(list(router.curr_replicas.values()), request)
    chosen = min(ranks[0], key=lambda replica: replica.queue_len)
    router.on_request_routed(request, chosen.replica_id, None)
    return chosen.replica_id.unique_id


def _set_load(router: PrefixAwareRouter, replica: StandInReplica, queue_len: int) -> None:
    replica.queue_len = queue_len
    router.on_new_queue_len_info(replica.replica_id, queue_len)


SYSTEM_A = list(range(100, 112))  # three blocks
SYSTEM_B = list(range(200, 212))


def test_block_chains_agree_exactly_as_far_as_the_prompts_share_whole_blocks():
    one = prompt_block_chain(SYSTEM_A + [1, 2, 3, 4, 5], BLOCK)
    two = prompt_block_chain(SYSTEM_A + [9, 9, 9, 9], BLOCK)
    assert len(one) == 4 and len(two) == 4 and one[:3] == two[:3] and one[3] != two[3]
    assert prompt_block_chain(SYSTEM_A, BLOCK, salt="tenant-1")[0] != prompt_block_chain(SYSTEM_A, BLOCK)[0]
    assert prompt_block_chain([1, 2, 3], BLOCK) == []  # less than a block: nothing to share
    assert len(prompt_block_chain(list(range(100)), BLOCK, max_tokens=10)) == 2


def test_prompts_sharing_a_prefix_follow_the_replica_that_took_it():
    async def run():
        replicas = [StandInReplica(f"r{i}") for i in range(4)]
        router = _router(replicas)
        first_a = await _route(router, replicas, _request(SYSTEM_A + [1, 2, 3, 4]))
        first_b = await _route(router, replicas, _request(SYSTEM_B + [1, 2, 3, 4]))
        for user in range(10):
            assert await _route(router, replicas, _request(SYSTEM_A + [user] * 5)) == first_a
            assert await _route(router, replicas, _request(SYSTEM_B + [user] * 5)) == first_b

    asyncio.run(run())


def test_a_hot_prefix_spills_to_the_least_loaded_replica_beyond_the_imbalance_bound():
    async def run():
        replicas = [StandInReplica("r0"), StandInReplica("r1")]
        router = _router(replicas, max_imbalance=2)
        holder_id = await _route(router, replicas, _request(SYSTEM_A + [0] * 4))
        holder, other = sorted(replicas, key=lambda replica: replica.replica_id.unique_id != holder_id)
        _set_load(router, holder, 2)  # within the bound of the idle one
        assert await _route(router, replicas, _request(SYSTEM_A + [1] * 4)) == holder_id
        _set_load(router, holder, 3)  # past it: the load decides
        assert await _route(router, replicas, _request(SYSTEM_A + [2] * 4)) == other.replica_id.unique_id
        # Now both hold the prefix: the less loaded holder takes the next one.
        _set_load(router, other, 1)
        assert await _route(router, replicas, _request(SYSTEM_A + [3] * 4)) == other.replica_id.unique_id

    asyncio.run(run())


def test_separate_routers_place_a_new_prefix_on_the_same_replica():
    async def run():
        replicas = [StandInReplica(f"r{i}") for i in range(4)]
        routers = [_router(replicas), _router(list(reversed(replicas)))]
        prompts = [[system] * 8 + [user] * 4 for system in range(20) for user in range(2)]
        for prompt in prompts:
            choices = {await _route(router, replicas, _request(prompt)) for router in routers}
            assert len(choices) == 1
        # ... and spread different prefixes over the replicas.
        placed = {await _route(routers[0], replicas, _request([system] * 8)) for system in range(20)}
        assert len(placed) >= 3

    asyncio.run(run())


def test_few_hot_prefixes_spread_evenly_over_the_replicas():
    async def run():
        for seed in range(10):  # replica ids change the ranking, not the balance
            replicas = [StandInReplica(f"s{seed}-r0"), StandInReplica(f"s{seed}-r1")]
            router = _router(replicas, max_imbalance=100)
            placed = [await _route(router, replicas, _request([seed * 100 + system] * 8)) for system in range(8)]
            assert sorted(placed.count(replica.replica_id.unique_id) for replica in replicas) in ([4, 4], [3, 5])

    asyncio.run(run())


def test_calls_without_a_prompt_and_short_prompts_go_by_load():
    async def run():
        replicas = [StandInReplica("r0"), StandInReplica("r1"), StandInReplica("r2")]
        router = _router(replicas)
        for request in (_request([1, 2]), _request(SYSTEM_A, method="get_stats")):
            ranks = await router.choose_replicas(list(router.curr_replicas.values()), request)
            assert len(ranks) == 1 and len(ranks[0]) == 2  # two random replicas; the shorter queue wins

    asyncio.run(run())


def test_a_replicas_table_keeps_as_many_blocks_as_its_kv_cache_and_forgets_removed_replicas():
    async def run():
        small, large = StandInReplica("small", kv_cache_tokens=3 * BLOCK), StandInReplica("large")
        router = _router([small, large], max_imbalance=100)
        for system in range(5):
            router.on_request_routed(_request([system] * 12), small.replica_id, None)
        assert router.prefixes.num_blocks(small.replica_id) == 3
        # The oldest prompts are forgotten, the last one is still held.
        assert router.prefixes.longest_match(prompt_block_chain([4] * 12, BLOCK), {small.replica_id})[0] == 3
        assert router.prefixes.longest_match(prompt_block_chain([0] * 12, BLOCK), {small.replica_id})[0] == 0
        router.update_replicas([large])
        assert router.prefixes.num_blocks(small.replica_id) == 0

    asyncio.run(run())


def test_routed_prefixes_match_the_longest_held_run():
    table = RoutedPrefixes()
    a, b = (ReplicaID(unique_id=name, deployment_id=DEPLOYMENT) for name in "ab")
    table.add(a, [1, 2, 3], capacity=10)
    table.add(b, [1, 2], capacity=10)
    assert table.longest_match([1, 2, 3, 4], {a, b}) == (3, {a})
    assert table.longest_match([1, 2, 9], {a, b}) == (2, {a, b})
    assert table.longest_match([1, 2, 3], {b}) == (2, {b})
    assert table.longest_match([7], {a, b}) == (0, set())


@pytest.mark.parametrize("kwargs,message", [({"block_size": 0}, "block_size must be >= 1, got 0"),
                                            ({"max_imbalance": -1}, "max_imbalance must be >= 0, got -1")])
def test_bad_router_settings_are_named(kwargs, message):
    router = PrefixAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    with pytest.raises(ValueError, match=message):
        router.initialize_state(**kwargs)
