"""Continuous batching: which sequences run this step, with how many tokens, in which KV blocks.

Each step spends a budget of `max_num_tokens` tokens over at most `max_batch_size` sequences. Running
requests go first, in priority order (higher priority, then earlier arrival); a long prompt is split
into chunks across steps. When the cache runs out of blocks, the lowest-priority running request is
preempted: its blocks are freed and it is computed again later (recompute). Waiting requests are then
admitted in the same order until one does not fit. A request's sequences are scheduled together.

Under the GUARANTEED_NO_EVICT policy a waiting request is admitted only when the free blocks cover all it may ever
need (its prompt and max_tokens, for each of its sequences) beside what every running request may still need, so
no request is preempted; MAX_UTILIZATION (the default) admits while the next chunk fits and preempts when needed.

On an engine serving LoRA adapters, a waiting request with an adapter is admitted only once its adapter has a
device slot (engine/lora_slots.py); it waits while every slot holds an adapter that running requests use.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.lora_slots import LoraSlots
from raylm.engine.request import Request, RequestStatus, Sequence


@dataclass(slots=True)
class ScheduledSequence:
    request: Request
    seq: Sequence
    start: int  # position of the first token computed this step
    num_tokens: int
    # True when this step computes the sequence's last token (as scheduled), so a new token is drawn.
    completes: bool = False
    placeholder: bool = False  # its draw went into the sequence as a placeholder at launch (overlap)
    # Draft tokens computed after the sequence's last token (speculative decoding), each position drawn and checked.
    drafts: list[int] | tuple[()] = ()

    @property
    def token_ids(self) -> list[int]:
        tokens = self.seq.token_ids[self.start : self.start + self.num_tokens]
        return tokens + self.drafts if self.drafts else tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSequence] = field(default_factory=list)  # one token each
    prefills: list[ScheduledSequence] = field(default_factory=list)  # chunks of several tokens
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Adapters to load into device slots before this step's forward: (slot, LoRARequest).
    lora_loads: list[tuple] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.decodes) + sum(item.num_tokens for item in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 enable_chunked_prefill: bool = True, guarantee_no_evict: bool = False,
                 lora_slots: LoraSlots | None = None):
        self.kv_cache = kv_cache
        self.lora_slots = lora_slots  # None: the engine serves no LoRA adapters
        self.guarantee_no_evict = guarantee_no_evict
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # Pipelines set this: a request whose draw is still in flight (a placeholder token) waits for it instead
        # of joining the next step, so that consecutive steps hold different sequences and the stages work on
        # both at once (actors/distributed_runner.py).
        self.skip_in_flight = False
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    # ------------------------------------------------------------------ queues

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=Request.sort_key)

    def finish_request(self, request: Request) -> None:
        """Frees every block of a request and removes it from the queues."""
        for seq in request.sequences:
            self.kv_cache.free(seq)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    def preempt(self, request: Request) -> None:
        """Frees a running request's blocks and queues it to be computed again (recompute)."""
        for seq in request.sequences:
            self.kv_cache.free(seq)
            seq.reset_for_recompute()
        request.num_preemptions += 1
        self.running.remove(request)
        self.add_request(request)

    # ------------------------------------------------------------------ capacity

    def _blocks_at_most(self, request: Request) -> int:
        """The most blocks a request can hold: its prompt and every output token, in each of its sequences."""
        params = request.sampling_params
        tokens = request.num_prompt_tokens + params.max_tokens
        return -(-tokens // self.kv_cache.block_size) * params.num_sequences

    def _fits_for_good(self, request: Request) -> bool:
        """Whether the free blocks cover all that `request` and every running request may still take."""
        reserved = 0
        for running in self.running:
            held = {block for seq in running.sequences for block in seq.block_ids}
            reserved += max(0, self._blocks_at_most(running) - len(held))
        return self._blocks_at_most(request) + reserved <= self.kv_cache.num_free_blocks

    # ------------------------------------------------------------------ planning

    def _plan(self, request: Request, budget: int) -> list[tuple[Sequence, int]] | None:
        """Tokens per live sequence this step, or None when the budget cannot serve every sequence."""
        if len(request.sequences) == 1:  # the common case, kept cheap: one sequence
            seq = request.sequences[0]
            wanted = len(seq.token_ids) - seq.num_computed_tokens
            if seq.finish_reason is not None or wanted <= 0:
                return []
            if seq.num_output_tokens >= request.sampling_params.max_tokens:
                return []  # a placeholder still in flight is its last token
            if wanted > budget and not (self.enable_chunked_prefill or request.num_preemptions > 0):
                return None
            return [(seq, min(wanted, budget))]
        live = [seq for seq in request.live_sequences if seq.num_uncomputed_tokens > 0]
        if not live:
            return []
        if request.is_beam_search and len(live) > 1 and any(s.num_uncomputed_tokens > 1 for s in live):
            # Beams recomputing after preemption all finish their prefix first, then take their
            # last token in one step together, so that one beam step sees every beam's logits.
            wanted = [(seq, seq.num_uncomputed_tokens - 1) for seq in live]
        else:
            wanted = [(seq, seq.num_uncomputed_tokens) for seq in live]
        wanted = [(seq, tokens) for seq, tokens in wanted if tokens > 0]
        # Recompute after preemption may chunk even without chunked prefill: prompt plus output can outgrow
        # the budget that admitted the prompt.
        may_chunk = self.enable_chunked_prefill or request.num_preemptions > 0
        plan = []
        for position, (seq, tokens) in enumerate(wanted):
            later = len(wanted) - position - 1  # keep a token for every later sequence
            if tokens > budget - later and not may_chunk:
                return None
            take = min(tokens, budget - later)
            if take <= 0:
                return None
            plan.append((seq, take))
            budget -= take
        return plan

    def _allocate(self, request: Request, plan: list[tuple[Sequence, int]]) -> bool:
        if len(plan) == 1:  # allocate() checks the capacity of a single sequence itself
            return self.kv_cache.allocate(request, plan[0][0], plan[0][1])
        if self.kv_cache.blocks_needed_for(plan) > self.kv_cache.num_free_blocks:
            return False
        for seq, tokens in plan:
            if not self.kv_cache.allocate(request, seq, tokens):
                raise RuntimeError("KV cache accounting error: allocation failed after the capacity check")
        return True

    def _emit(self, out: SchedulerOutput, request: Request, plan: list[tuple[Sequence, int]]) -> int:
        total = 0
        for seq, tokens in plan:
            start = seq.num_computed_tokens
            item = ScheduledSequence(request, seq, start, tokens, start + tokens == len(seq.token_ids))
            (out.decodes if tokens == 1 else out.prefills).append(item)
            total += tokens
        return total

    # ------------------------------------------------------------------ one step

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """This step's work. drafts: draft tokens by id(request) for running requests whose last token is known
        (speculative decoding), each computed after that token within the budget."""
        out = SchedulerOutput()
        token_budget = self.max_num_tokens
        seq_budget = self.max_batch_size

        index = 0
        running, decodes, fits_in_partial_block = self.running, out.decodes, self.kv_cache.fits_in_partial_block
        while index < len(running) and token_budget > 0:
            request = running[index]
            if self.skip_in_flight and request.awaits_draw:
                index += 1
                continue
            if drafts and id(request) in drafts:
                scheduled = self._schedule_drafted(out, request, drafts[id(request)], token_budget, seq_budget)
                if scheduled is None:
                    break
                token_budget -= scheduled
                seq_budget -= 1
                index += 1
                continue
            if len(request.sequences) == 1 and seq_budget > 0:
                # The common case, kept cheap: one sequence decoding one token into its own partial block
                # (the same outcome as _plan, _allocate and _emit below, without building a plan).
                seq = request.sequences[0]
                computed = seq.num_computed_tokens
                length = len(seq.token_ids)
                if length - computed == 1 and seq.finish_reason is None and fits_in_partial_block(seq, 1):
                    if length - seq.num_prompt_tokens < request.sampling_params.max_tokens:
                        decodes.append(ScheduledSequence(request, seq, computed, 1, True))
                        token_budget -= 1
                        seq_budget -= 1
                    index += 1
                    continue
            plan = self._plan(request, token_budget)
            if plan is None or len(plan) > seq_budget:
                break
            while not self._allocate(request, plan):
                victim = self.running[-1]
                self.preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    plan = None
                    break
            if plan is None:
                break
            token_budget -= self._emit(out, request, plan)
            seq_budget -= len(plan)
            index += 1

        while self.waiting and not out.num_preempted and token_budget > 0 and seq_budget > 0:
            request = self.waiting[0]
            if self.skip_in_flight and request.awaits_draw:  # preempted while its draw was in flight
                break
            if self.guarantee_no_evict and self.running and not self._fits_for_good(request):
                break  # (with nothing running it goes ahead: it could never be admitted otherwise)
            if request.lora_request is not None and not self._place_adapter(request):
                break  # every adapter slot is in use by running requests
            looks_up = not request.forked and request.sequences[0].num_computed_tokens == 0
            hits = self.kv_cache.match_prefix(request) if looks_up else []
            first = request.sequences[0]
            if hits:
                first.num_computed_tokens = len(hits) * self.kv_cache.block_size  # tentatively, for planning
            plan = self._plan(request, token_budget)
            if hits:
                first.num_computed_tokens = 0
            if plan is None or len(plan) > seq_budget:
                break
            if hits:  # an unforked request: the plan is its one sequence
                if not self.kv_cache.allocate(request, first, plan[0][1], prefix_hits=hits):
                    break
            elif not self._allocate(request, plan):
                break
            if looks_up:
                self.kv_cache.count_prefix_misses(request, len(hits))
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = len(hits) * self.kv_cache.block_size
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=Request.sort_key)
            token_budget -= self._emit(out, request, plan)
            seq_budget -= len(plan)

        out.block_copies = self.kv_cache.take_pending_copies()
        if self.lora_slots is not None and not out.is_empty:  # else they wait for the next step that runs
            out.lora_loads = self.lora_slots.take_pending_loads()
        return out

    def _schedule_drafted(self, out: SchedulerOutput, request: Request, proposal: list[int], token_budget: int,
                          seq_budget: int) -> int | None:
        """Schedules a running request's last token and as many of its drafts as the budget takes (preempting
        the lowest-priority requests for blocks as a decode does); returns the tokens it takes, or None when it
        cannot run this step."""
        if seq_budget <= 0:
            return None
        seq = request.sequences[0]
        take = 1 + min(len(proposal), token_budget - 1)
        while not self._allocate(request, [(seq, take)]):
            victim = self.running[-1]
            self.preempt(victim)
            out.num_preempted += 1
            if victim is request:
                return None
        item = ScheduledSequence(request, seq, seq.num_computed_tokens, take, True, drafts=proposal[: take - 1])
        (out.prefills if take > 1 else out.decodes).append(item)
        return take

    def _place_adapter(self, request: Request) -> bool:
        """Gives a request about to be admitted the slot of its adapter; False when none is free for it."""
        if self.lora_slots is None:
            raise ValueError(f"request {request.request_id!r} asks for a LoRA adapter, but the engine serves none "
                             "(lora_config)")
        slot = self.lora_slots.acquire(request.lora_request, self.running)
        if slot is None:
            return False
        request.lora_slot = slot
        return True
