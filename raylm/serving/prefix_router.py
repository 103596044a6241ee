"""Prefix-aware routing of generation requests across engine replicas: a Ray Serve request router.

A request whose prompt starts like one routed before goes to the replica that took it, whose prefix cache likely
still holds its KV blocks, as long as that replica's queue is within `max_imbalance` requests of the least loaded
one; otherwise, and for calls that carry no prompt, two random replicas are asked and the shorter queue wins (power
of two choices, Serve's default).

The router keeps, per replica, the block hashes of the prompts it sent there (RoutedPrefixes): a hash chain over
blocks of the engine's tokens_per_block, so a match of n blocks means the first n blocks of the prompt equal those
of a routed prompt, as in the engine's own prefix cache. Each replica's table keeps as many blocks as its KV cache
holds (the engine reports its capacity through record_routing_stats), dropping the least recently routed first,
as the engine evicts its least recently freed blocks.

Every ingress replica routes with a router of its own. A prompt none of its replicas is known to hold goes where
rendezvous hashing of its first blocks points, so that the routers place a new prefix on the same replica without
talking to each other; but past a replica already holding more than PLACEMENT_SLACK times its share of the
prefixes placed, to the next replica of the ranking (consistent hashing with bounded loads), so that a few hot
prefixes spread evenly. Its queue bounds that choice as it bounds a match.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# Prompt tokens the router hashes at most: prompts that agree this far go to the same replica anyway, and the cost
# of routing stays bounded for long prompts (about a microsecond a block).
MAX_ROUTED_TOKENS = 4096
# Blocks a replica's table keeps before its engine reports its KV capacity.
DEFAULT_TABLE_BLOCKS = 65536
# The first blocks of a prompt that decide where a prefix nobody holds goes (rendezvous hashing): enough to tell
# system prompts apart past a chat template's common opening, few enough to be shared by every user of one.
PLACEMENT_BLOCKS = 2
# A replica takes a new prefix while it holds fewer than this times its share of the placed prefixes.
PLACEMENT_SLACK = 1.25
# Routed prompts whose block chains are kept between choosing a replica and hearing where the request went.
PENDING_CHAINS = 4096
# The engine deployment's method that carries prompts (EngineDeployment.stream); its first argument is the prompt,
# its fourth the cache salt.
STREAM_METHOD = "stream"


def prompt_block_chain(token_ids: list[int], block_size: int, salt: str | None = None,
                       max_tokens: int = MAX_ROUTED_TOKENS) -> list[int]:
    """The keys of the prompt's full blocks (up to max_tokens), each chained on every token before it: two prompts
    share their first n keys exactly when they share their first n blocks (and cache salt)."""
    chain: list[int] = []
    parent = stable_hash(salt) if salt else 0
    end = min(len(token_ids), max_tokens)
    for start in range(0, end - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start:start + block_size]))
        chain.append(parent)
    return chain


def placement_key(chain: list[int]) -> int:
    """The key of a prompt's first blocks, which places a prefix no replica holds."""
    return chain[min(len(chain), PLACEMENT_BLOCKS) - 1]


def stable_hash(text: str) -> int:
    """A 64-bit hash of text that every process agrees on (Python's hash of a str differs between processes; its
    hash of ints and tuples of ints does not)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def request_block_chain(args: list[Any], block_size: int) -> list[int]:
    """The block chain of a stream call's prompt (its token ids, as the ingress sends them); [] when the call
    carries no token ids."""
    if not args:
        return []
    inputs = args[0]
    token_ids = inputs.get("prompt_token_ids") if isinstance(inputs, dict) else inputs
    if not isinstance(token_ids, list):
        return []
    salt = args[3] if len(args) > 3 and isinstance(args[3], str) else None
    return prompt_block_chain(token_ids, block_size, salt)


class RoutedPrefixes:
    """Per replica, the block keys of the prompts routed there, least recently routed first, at most its capacity;
    and per key, the replicas that hold it."""

    def __init__(self):
        self._blocks: dict[ReplicaID, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[ReplicaID]] = {}
        self._placed: dict[ReplicaID, set[int]] = {}  # the placement keys among a replica's blocks

    def add(self, replica_id: ReplicaID, chain: list[int], capacity: int) -> None:
        """Records that replica_id took a prompt of this chain; drops its oldest keys beyond capacity."""
        self._placed.setdefault(replica_id, set()).add(placement_key(chain))
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        for key in chain:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
                self._holders.setdefault(key, set()).add(replica_id)
        while len(blocks) > capacity:
            self._drop(replica_id, blocks.popitem(last=False)[0])

    def longest_match(self, chain: list[int], replica_ids: set[ReplicaID]) -> tuple[int, set[ReplicaID]]:
        """How many leading blocks of chain some of replica_ids hold, and which of them hold that many."""
        depth, best = 0, set()
        for index, key in enumerate(chain):
            holders = self._holders.get(key)
            if not holders or not (holders := holders & replica_ids):
                break
            depth, best = index + 1, holders
        return depth, best

    def num_placed(self, replica_id: ReplicaID) -> int:
        """How many distinct prefixes (placement keys) the replica holds."""
        return len(self._placed.get(replica_id, ()))

    def remove_replica(self, replica_id: ReplicaID) -> None:
        for key in self._blocks.pop(replica_id, {}):
            self._drop(replica_id, key)
        self._placed.pop(replica_id, None)

    def replica_ids(self) -> set[ReplicaID]:
        return set(self._blocks)

    def num_blocks(self, replica_id: ReplicaID) -> int:
        return len(self._blocks.get(replica_id, ()))

    def _drop(self, replica_id: ReplicaID, key: int) -> None:
        self._placed.get(replica_id, set()).discard(key)
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self._holders[key]


class PrefixAwareRouter(RequestRouter):
    """Routes a prompt to the replica that holds its longest prefix, within a bound on queue imbalance (see the
    module's notes); power of two choices for everything else."""

    def initialize_state(self, block_size: int = 32, max_imbalance: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.prefixes = RoutedPrefixes()
        self._chains: OrderedDict[str, list[int]] = OrderedDict()  # internal request id -> prompt's chain

    # ------------------------------------------------------------------ Serve's hooks

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        two = self._two_choices(candidate_replicas)
        chain = self._chain(pending_request)
        if not chain:
            return [two]
        preferred = self.preferred_replica(chain, candidate_replicas)
        if preferred is None:
            return [two]
        return [[preferred], two]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        chain = self._chains.pop(pending_request.metadata.internal_request_id, None)
        if chain is None:
            chain = self._chain(pending_request, remember=False)
        replica = self.curr_replicas.get(replica_id)
        if chain and replica is not None:
            self.prefixes.add(replica_id, chain, self._capacity_blocks(replica))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for replica_id in self.prefixes.replica_ids() - set(self.curr_replicas):
            self.prefixes.remove_replica(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.prefixes.remove_replica(replica_id)

    # ------------------------------------------------------------------ the policy

    def preferred_replica(self, chain: list[int], candidates: list[RunningReplica]) -> RunningReplica | None:
        """The replica a prompt of this chain should go to, or None to balance by load alone: the least loaded of
        those holding its longest routed prefix, else the rendezvous choice of its first blocks; either only
        while its queue is within max_imbalance of the shortest."""
        loads = {replica.replica_id: self.queue_length(replica) for replica in candidates}
        by_id = {replica.replica_id: replica for replica in candidates}
        _, holders = self.prefixes.longest_match(chain, set(by_id))
        if holders:
            choice = min(holders, key=lambda replica_id: (loads[replica_id], replica_id.unique_id))
        else:
            choice = self.placement(chain, list(by_id))
        if loads[choice] > min(loads.values()) + self.max_imbalance:
            return None
        return by_id[choice]

    def placement(self, chain: list[int], replica_ids: list[ReplicaID]) -> ReplicaID:
        """Where a prefix that no replica holds goes: the first replica in its rendezvous ranking that holds fewer
        than PLACEMENT_SLACK times its share of the prefixes placed."""
        key = placement_key(chain)
        ranking = sorted(replica_ids, key=lambda replica_id: stable_hash(f"{key}:{replica_id.unique_id}"),
                         reverse=True)
        placed = {replica_id: self.prefixes.num_placed(replica_id) for replica_id in replica_ids}
        bound = math.ceil(PLACEMENT_SLACK * (sum(placed.values()) + 1) / len(replica_ids))
        return next((replica_id for replica_id in ranking if placed[replica_id] < bound), ranking[0])

    def queue_length(self, replica: RunningReplica) -> int:
        """Requests in flight on the replica, as Serve last heard (0 before it has)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    # ------------------------------------------------------------------ helpers

    def _chain(self, pending_request: PendingRequest | None, remember: bool = True) -> list[int]:
        if pending_request is None or pending_request.metadata.call_method != STREAM_METHOD:
            return []
        request_id = pending_request.metadata.internal_request_id
        chain = self._chains.get(request_id)
        if chain is None:
            chain = request_block_chain(pending_request.args, self.block_size)
            if remember and chain:
                self._chains[request_id] = chain
                while len(self._chains) > PENDING_CHAINS:  # requests cancelled before they were routed
                    self._chains.popitem(last=False)
        return chain

    def _capacity_blocks(self, replica: RunningReplica) -> int:
        """How many of the router's blocks the replica's KV cache holds, as its engine reports (record_routing_stats
        of EngineDeployment)."""
        tokens = (replica.routing_stats or {}).get("kv_cache_tokens")
        return max(1, tokens // self.block_size) if tokens else DEFAULT_TABLE_BLOCKS

    @staticmethod
    def _two_choices(candidates: list[RunningReplica]) -> list[RunningReplica]:
        return random.sample(candidates, min(2, len(candidates)))
