"""The KV cache manager: a pool of fixed-size blocks, per-sequence block tables, and the prefix cache.

A block is free when no sequence references it. With block reuse on, a full block is keyed by a hash
chained over every token before it (and the request's cache salt); a free block keeps its key until it is
evicted, so a later request with the same prefix takes it back instead of recomputing it. Free blocks
are evicted least recently freed first. Sequences forked from one another share blocks by reference
count; the first write into a shared, partially filled last block copies it (copy-on-write).

Block 0 is the null block: never handed out, kept zero by the model runner, and the target of every
padded slot in attention, so cache memory can be left uninitialised.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from raylm.engine.request import Request, Sequence

NULL_BLOCK = 0


def hash_chain_root(weight_version: int, lora_int_id: int | None = None, lora_generation: int = 0) -> int | None:
    """The key every block-hash chain of a request starts from: the weight version it was admitted under and the
    LoRA adapter it runs with (its id, and how many times an adapter under that id was removed: a replaced adapter's
    KV is another's), so KV computed with other weights or another adapter never matches (None, no root, for the
    weights the engine started with and no adapter)."""
    if not weight_version and not lora_int_id:
        return None
    text = f"weight-version:{weight_version}"
    if lora_int_id:
        text += f"/lora:{lora_int_id}" + (f".{lora_generation}" if lora_generation else "")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def hash_block(parent_hash: int | None, token_ids: list[int], salt: str | None) -> int:
    """A stable 64-bit key of a full block, chained on the key of the block before it."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<Q", parent_hash or 0))
    digest.update(array("q", token_ids).tobytes())
    if salt:
        digest.update(salt.encode())
    return int.from_bytes(digest.digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


class KVCacheManager:
    """Owns every block: allocation, sharing, prefix matching, eviction and the statistics of all that."""

    def __init__(self, num_blocks: int, block_size: int, enable_block_reuse: bool, event_buffer_max_size: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV cache must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_block_reuse = enable_block_reuse
        self.blocks = [Block(i) for i in range(num_blocks + 1)]  # block ids 1..num_blocks; 0 is the null block
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[int, Block] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.alloc_total_blocks = 0
        self.alloc_new_blocks = 0
        self.reused_blocks = 0
        self.missed_blocks = 0
        self.events: deque[dict] | None = deque(maxlen=event_buffer_max_size) if event_buffer_max_size else None
        self._event_id = 0
        self._emit({"type": "created", "num_blocks_per_cache_level": [num_blocks]})

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks that computing num_new_tokens more tokens of seq would take from the free pool."""
        computed = seq.num_computed_tokens
        total = -(-(computed + num_new_tokens) // self.block_size)
        needed = max(0, total - len(seq.block_ids))
        if computed % self.block_size and self._needs_copy(seq, num_new_tokens):
            needed += 1
        return needed

    def blocks_needed_for(self, plan: list[tuple[Sequence, int]]) -> int:
        """Blocks a whole step plan takes: several sharers of one partial block writing in the same step need
        one copy fewer than their number when they are all of its sharers (the last one writes in place)."""
        needed = 0
        writers: dict[int, int] = {}
        for seq, num_new_tokens in plan:
            needed += self.blocks_needed(seq, num_new_tokens)
            shared = self._shared_partial_block(seq, num_new_tokens)
            if shared is not None:
                writers[shared] = writers.get(shared, 0) + 1
        for block_id, count in writers.items():
            if count >= self.blocks[block_id].ref_count:
                needed -= 1
        return needed

    def _shared_partial_block(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """The partially filled, shared block that writing num_new_tokens into seq would copy, if any."""
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return None
        last = seq.num_computed_tokens // self.block_size
        if last < len(seq.block_ids) and self.blocks[seq.block_ids[last]].ref_count > 1:
            return seq.block_ids[last]
        return None

    def _needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._shared_partial_block(seq, num_new_tokens) is not None

    def stats(self) -> dict:
        lookups = self.reused_blocks + self.missed_blocks
        return {
            "maxNumBlocks": self.num_blocks,
            "freeNumBlocks": self.num_free_blocks,
            "usedNumBlocks": self.num_used_blocks,
            "tokensPerBlock": self.block_size,
            "allocTotalBlocks": self.alloc_total_blocks,
            "allocNewBlocks": self.alloc_new_blocks,
            "reusedBlocks": self.reused_blocks,
            "missedBlocks": self.missed_blocks,
            "cacheHitRate": self.reused_blocks / lookups if lookups else 0.0,
        }

    # ------------------------------------------------------------------ prefix cache

    def prompt_block_hashes(self, request: Request) -> list[int]:
        hashes: list[int] = []
        parent = request.hash_root
        size = self.block_size
        for start in range(0, request.num_prompt_tokens - size + 1, size):
            parent = hash_block(parent, request.prompt_token_ids[start : start + size], request.cache_salt)
            hashes.append(parent)
        return hashes

    def match_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks that starts the prompt, leaving at least one token to compute."""
        if not self.enable_block_reuse or request.wants_prompt_logprobs:
            return []
        if not request.prompt_block_hashes:
            request.prompt_block_hashes = self.prompt_block_hashes(request)
        limit = (request.num_prompt_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in request.prompt_block_hashes[:limit]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def register_full_blocks(self, request: Request, seq: Sequence) -> None:
        """Keys the blocks of seq that its computed tokens have filled, so later requests can reuse them."""
        if not self.enable_block_reuse:
            return
        size = self.block_size
        if seq.num_computed_tokens // size <= seq.num_hashed_blocks:
            return
        num_full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // size, len(seq.block_ids))
        if num_full <= seq.num_hashed_blocks:
            return
        stored: list[dict] = []
        parent_hash = None
        for index in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_ids[index]]
            tokens = seq.token_ids[index * size : (index + 1) * size]
            block_hash = block.block_hash
            if block_hash is None:
                parent = seq.last_block_hash if index else request.hash_root
                block_hash = hash_block(parent, tokens, request.cache_salt)
            if block.block_hash is None and block_hash not in self.cached:
                if not stored:
                    parent_hash = seq.last_block_hash
                block.block_hash = block_hash
                self.cached[block_hash] = block
                stored.append({"type": "stored_block", "block_hash": block_hash, "tokens": tokens})
            elif stored:  # a run of stored blocks ended: report it with its own parent
                self._emit({"type": "stored", "parent_hash": parent_hash, "blocks": stored})
                stored = []
            seq.last_block_hash = block_hash
        seq.num_hashed_blocks = num_full
        if stored:
            self._emit({"type": "stored", "parent_hash": parent_hash, "blocks": stored})

    # ------------------------------------------------------------------ allocation

    def fits_in_partial_block(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether num_new_tokens more tokens fit in seq's own (unshared) partial last block: nothing to allocate."""
        computed, size, blocks = seq.num_computed_tokens, self.block_size, seq.block_ids
        return (computed % size != 0 and computed + num_new_tokens <= len(blocks) * size
                and self.blocks[blocks[computed // size]].ref_count == 1)

    def allocate(self, request: Request, seq: Sequence, num_new_tokens: int,
                 prefix_hits: list[Block] | None = None) -> bool:
        """Gives seq the blocks for num_new_tokens more tokens (after any prefix hits); False if they don't fit.

        On success with prefix hits, the hit blocks start seq's table and seq.num_computed_tokens moves
        past them. Nothing changes on failure.
        """
        if not prefix_hits and self.fits_in_partial_block(seq, num_new_tokens):  # the common decode case
            return True
        hits = prefix_hits or []
        evictable_hits = sum(1 for block in hits if block.ref_count == 0)
        if hits:
            total = -(-(len(hits) * self.block_size + num_new_tokens) // self.block_size)
            needed = total - len(hits)
        else:
            needed = self.blocks_needed(seq, num_new_tokens)
        if needed + evictable_hits > self.num_free_blocks:
            return False
        if hits:
            for block in hits:
                self._take(block)
            seq.block_ids = [block.block_id for block in hits]
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_hashed_blocks = len(hits)
            seq.last_block_hash = hits[-1].block_hash
            self.reused_blocks += len(hits)
            self.alloc_total_blocks += len(hits)
        if seq.num_computed_tokens % self.block_size and self._needs_copy(seq, num_new_tokens):
            last = seq.num_computed_tokens // self.block_size
            source = self.blocks[seq.block_ids[last]]
            copy = self._pop_free()
            self.pending_copies.append((source.block_id, copy.block_id))
            source.ref_count -= 1
            blocks = list(seq.block_ids)  # a new list: block lists are only ever appended to (Sequence.block_ids)
            blocks[last] = copy.block_id
            seq.block_ids = blocks
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_ids) < total:
            seq.block_ids.append(self._pop_free().block_id)
        return True

    def count_prefix_misses(self, request: Request, num_hits: int) -> None:
        """Statistics: the prompt's full blocks that the prefix cache did not have."""
        if self.enable_block_reuse and not request.wants_prompt_logprobs:
            self.missed_blocks += max(0, request.num_prompt_tokens // self.block_size - num_hits)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent."""
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        child.block_ids = list(parent.block_ids)

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks; the last blocks of a sequence go to the front of the eviction order."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = block
        seq.block_ids = []

    def forget_cached_prefixes(self) -> None:
        """Every cached block's key goes (its KV was released): no later request can match it."""
        removed = [block.block_hash for block in self.cached.values()]
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if removed:
            self._emit({"type": "removed", "block_hashes": removed})

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def _pop_free(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            self._emit({"type": "removed", "block_hashes": [block.block_hash]})
            block.block_hash = None
        block.ref_count = 1
        self.alloc_total_blocks += 1
        self.alloc_new_blocks += 1
        return block

    # ------------------------------------------------------------------ events

    def _emit(self, data: dict) -> None:
        if self.events is None:
            return
        self.events.append({"event_id": self._event_id, "data": data, "window_size": self.block_size})
        self._event_id += 1

    def take_events(self) -> list[dict]:
        if self.events is None:
            return []
        events = list(self.events)
        self.events.clear()
        return events
