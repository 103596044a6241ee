"""A step's plan: the flattened tokens, cache slots and logits every rank needs to run one engine step.

Plain data, made from a schedule on rank 0 by `plan_step`, which changes nothing; the same plan goes to every rank
of a multi-rank engine (actors/distributed_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raylm.engine.request import PLACEHOLDER
from raylm.engine.scheduler import ScheduledSequence, SchedulerOutput


@dataclass
class PromptLogprobSpec:
    """Prompt positions whose next-token log-probabilities a request asked for."""

    request_id: str
    rows: list[int]  # rows of the step's hidden states (position p scores prompt token p + 1)
    targets: list[int]  # the prompt tokens scored
    num_top: int


@dataclass
class StepPlan:
    """What every rank needs to run one step: flattened tokens, cache slots, and which logits to produce."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    decode_contexts: list[tuple[list[int], int]] = field(default_factory=list)
    prefill_chunks: list[tuple[list[int], int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobSpec] = field(default_factory=list)
    # Rows whose input token is a placeholder: the step still in flight samples it, on the device.
    feed_rows: list[int] = field(default_factory=list)
    # When that step's draws were its decode graph's greedy draws, which every tensor-parallel rank computed
    # alike: their entries for feed_rows, which each rank takes from its own graph (nothing is broadcast).
    feed_sources: list[int] | None = None
    # Whether every row is a decode of a request with greedy draws (Request.greedy_draws): a decode graph then
    # computes the draws too.
    greedy: bool = False
    # LoRA: adapters to load into device slots before the forward, (slot, LoRARequest); each row's slot (-1: the
    # base model), empty when no row has an adapter.
    lora_loads: list[tuple] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)
    # Verify rows: several positions of one sequence as decode rows of their own, each attending to its prefix, so
    # that the step can replay a graph: speculative decoding's drafted sequences (the last token and the drafts),
    # and short prompts (plan_step's graph_rows). Their keys and values must all be stored before any row attends.
    verify_rows: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def plan_step(out: SchedulerOutput, block_size: int, graph_rows: int = 0) -> StepPlan:
    """Flattens a schedule (decodes first, then prefill chunks) into a StepPlan, changing nothing: runs on rank 0,
    where the requests live (Progress.launched then moves their prompt log-probabilities past this step's).
    graph_rows: the most rows of a step whose prompt tokens become decode rows of their own (verify rows), for the
    runner's prefill graphs to replay (0: prompts stay prefill chunks)."""
    plan = StepPlan(block_copies=list(out.block_copies))
    input_ids, positions, slots = plan.input_ids, plan.positions, plan.slot_mapping
    sample_rows, decode_contexts, feed_rows = plan.sample_rows, plan.decode_contexts, plan.feed_rows
    offset = 0
    greedy = True
    for item in out.decodes:  # one token each: the common case, kept cheap
        greedy = greedy and item.request.greedy_draws
        seq, position = item.seq, item.start
        blocks = seq.block_ids
        token = seq.token_ids[position]
        if token == PLACEHOLDER:
            feed_rows.append(offset)
        input_ids.append(token)
        positions.append(position)
        slots.append(blocks[position // block_size] * block_size + position % block_size)
        decode_contexts.append((blocks, position + 1))
        if item.completes:
            sample_rows.append(offset)
        if item.request.wants_prompt_logprobs:
            spec = _prompt_logprob_spec(item, offset)
            if spec is not None:
                plan.prompt_logprobs.append(spec)
        offset += 1
    drafted = [item for item in out.prefills if item.drafts]
    chunks = [item for item in out.prefills if not item.drafts] if drafted else out.prefills
    item_rows: dict[int, list[int]] = {}  # id(item) -> its sample rows, for a drafted step's order
    for item in drafted:  # the last token and the drafts: one decode row per position
        greedy = greedy and item.request.greedy_draws
        blocks = item.seq.block_ids
        rows = item_rows[id(item)] = []
        for index, token in enumerate(item.token_ids):
            position = item.start + index
            input_ids.append(token)
            positions.append(position)
            slots.append(blocks[position // block_size] * block_size + position % block_size)
            decode_contexts.append((blocks, position + 1))
            rows.append(offset)
            offset += 1
    as_rows = bool(chunks) and offset + sum(item.num_tokens for item in chunks) <= graph_rows
    plan.verify_rows = bool(drafted) or as_rows
    plan.greedy = greedy and not chunks and offset > 0
    for item in chunks:
        first_row = offset
        span = range(item.start, item.start + item.num_tokens)
        blocks = item.seq.block_ids
        input_ids.extend(item.token_ids)
        positions.extend(span)
        slots.extend(blocks[pos // block_size] * block_size + pos % block_size for pos in span)
        offset += item.num_tokens
        if as_rows:
            decode_contexts.extend((blocks, pos + 1) for pos in span)
        else:
            plan.prefill_chunks.append((blocks, item.start, item.num_tokens))
        if item.completes:
            if drafted:
                item_rows[id(item)] = [offset - 1]
            else:
                sample_rows.append(offset - 1)
        spec = _prompt_logprob_spec(item, first_row)
        if spec is not None:
            plan.prompt_logprobs.append(spec)
    if drafted:  # sample rows in the schedule's order, as the sampler takes its rows
        for item in out.prefills:
            sample_rows.extend(item_rows.get(id(item), ()))
    plan.lora_loads = list(out.lora_loads)
    plan.lora_slots = _lora_slots(out)
    return plan


def _lora_slots(out: SchedulerOutput) -> list[int]:
    """Each row's adapter slot, in the plan's row order (decodes, drafted sequences' rows, prefill chunks; -1: the
    base model); empty when no row has an adapter."""
    if all(item.request.lora_slot < 0 for item in out.scheduled):
        return []
    slots = [item.request.lora_slot for item in out.decodes]
    for drafted in (True, False):
        for item in out.prefills:
            if bool(item.drafts) == drafted:
                slots.extend([item.request.lora_slot] * item.num_tokens)
    return slots


def prompt_logprob_targets(item: ScheduledSequence) -> tuple[int, int] | None:
    """The first and last prompt positions whose log-probabilities this scheduled item reports (each position once,
    even when a preempted request computes its prompt again), or None."""
    request = item.request
    if not request.wants_prompt_logprobs or request.forked:
        return None
    last_target = min(item.start + item.num_tokens, request.num_prompt_tokens - 1)
    first_target = max(item.start + 1, request.prompt_logprobs_next)
    return (first_target, last_target) if first_target <= last_target else None


def _prompt_logprob_spec(item: ScheduledSequence, first_row: int) -> PromptLogprobSpec | None:
    targets = prompt_logprob_targets(item)
    if targets is None:
        return None
    request = item.request
    first_target, last_target = targets
    return PromptLogprobSpec(
        request_id=request.request_id,
        rows=[first_row + target - 1 - item.start for target in range(first_target, last_target + 1)],
        targets=request.prompt_token_ids[first_target : last_target + 1],
        num_top=request.sampling_params.prompt_logprobs or 0,
    )
