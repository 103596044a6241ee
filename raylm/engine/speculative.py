"""Speculative decoding: proposals that one target forward verifies.

A speculating sequence whose last token is known gets up to k draft tokens (NGramProposer) before the step is
scheduled. The step computes the last token and the drafts as one chunk over the cached prefix (k + 1 positions,
prefill-style attention) and draws a token at every position, each from the request's own target distribution.
The drafts are accepted while they equal those draws; the first draw that differs (or the draw after the last
draft) is the step's extra token. Drafts here are single tokens, not distributions, so that rule is rejection
sampling exactly: a draft d is kept with the target's probability p(d), and otherwise the token drawn is p's
draw given it is not d. Outputs therefore follow the target distribution for sampled requests and equal
non-speculative decoding for greedy ones. The KV written for rejected drafts is past the sequence's computed
length and is overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raylm.config import DraftTargetDecodingConfig, NGramDecodingConfig
from raylm.engine.request import PLACEHOLDER, Request, Sequence
from raylm.engine.scheduler import SchedulerOutput
from raylm.engine.step_plan import StepPlan
from raylm.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's draws can be verified position by position: one sequence, no beam search, and nothing
    that makes a position's distribution depend on the tokens drawn before it in the same step (penalties,
    min_tokens). A grammar's masks do depend on them, but on the drafts alone: each verify row is masked after its
    prefix of the drafts (Guide.fill_masks)."""
    return (params.use_speculative_decoding and params.num_sequences == 1 and not params.use_beam_search
            and not params.has_penalties and not params.min_tokens)


def draft_room(request: Request, max_draft_len: int, max_seq_len: int) -> int:
    """How many drafts a running request that speculates can take this step (0: none): its sequence's last token
    must be known and all it has uncomputed, and the step's tokens must stay within max_tokens and max_seq_len."""
    if not request.speculates:
        return 0
    seq = request.sequences[0]
    length = len(seq.token_ids)
    if seq.finish_reason is not None or length - seq.num_computed_tokens != 1 or seq.token_ids[-1] == PLACEHOLDER:
        return 0
    return max(0, min(max_draft_len, request.sampling_params.max_tokens - seq.num_output_tokens - 1,
                      max_seq_len - length - 1))


def fit_rows(drafts: dict[int, list[int]] | None, running: int, max_rows: int | None
             ) -> dict[int, list[int]] | None:
    """Drafts trimmed so that a verify step's rows (each running request's token, then its drafts) fit max_rows,
    the largest decode graph's batch: a step past it runs eagerly, slower than plain decoding (SmolLM2 at batch 64
    on the H200: 320 rows against a 256-row graph, 0.41x). Each request keeps an equal share, the rows left over
    going to the longest proposals first. None max_rows: no graphs, no trimming. No room at all: None, the step
    does not speculate (it then overlaps with the next, as max_concurrency's steps do)."""
    if drafts is None or max_rows is None:
        return drafts
    room = max_rows - running
    if room <= 0:  # also with no proposals (placeholders): the steps stay overlapped while the batch is this large
        return None
    if sum(len(proposal) for proposal in drafts.values()) <= room:
        return drafts
    share = room // len(drafts)
    lengths = {key: min(len(proposal), share) for key, proposal in drafts.items()}
    left = room - sum(lengths.values())
    for key in sorted(drafts, key=lambda key: len(drafts[key]), reverse=True):
        extra = min(left, len(drafts[key]) - lengths[key])
        lengths[key] += extra
        left -= extra
    return {key: proposal[: lengths[key]] for key, proposal in drafts.items() if lengths[key]}


class NGramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    trying n from max_matching_ngram_size down to 1. Each sequence keeps an index of its n-grams (their latest
    end position), extended by the tokens added since its last proposal: a proposal costs O(n) per new token,
    not a scan of the sequence."""

    def __init__(self, config: NGramDecodingConfig):
        self.max_draft_len = config.max_draft_len
        self.max_ngram = config.max_matching_ngram_size
        self.max_concurrency = config.max_concurrency

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        tokens = seq.token_ids
        index: _NGramIndex | None = seq.draft_state
        if index is None:
            index = seq.draft_state = _NGramIndex(self.max_ngram)
        # The suffix being looked up must not find itself: only the n-grams ending before the last token are indexed
        # (those ending at it are, once the sequence has grown past it).
        index.extend(tokens, len(tokens) - 1)
        drafts: list[int] = []
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            end = index.latest.get(tuple(tokens[-n:]))
            if end is not None:
                drafts = tokens[end : end + max_drafts]
                break
        return drafts

    def drafts_for(self, running: list[Request], max_seq_len: int) -> dict[int, list[int]] | None:
        """Drafts for the running requests that speculate, by id(request) (draft_room says which and how many).
        None when more requests run than max_concurrency."""
        if self.max_concurrency is not None and len(running) > self.max_concurrency:
            return None
        drafts: dict[int, list[int]] = {}
        for request in running:
            room = draft_room(request, self.max_draft_len, max_seq_len)
            if room:
                proposal = self.propose(request.sequences[0], room)
                if proposal:
                    drafts[id(request)] = proposal
        return drafts

    def fill(self, out: SchedulerOutput) -> None:
        """Nothing: prompt lookup's drafts are known before the step is scheduled."""


class _NGramIndex:
    """n-gram -> the position just past its latest occurrence, for the n-grams ending at positions < `indexed`."""

    __slots__ = ("max_n", "latest", "indexed")

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.latest: dict[tuple[int, ...], int] = {}
        self.indexed = 0

    def extend(self, tokens: list[int], end: int) -> None:
        """Indexes the n-grams ending at positions indexed..end (exclusive of end as an n-gram's end position)."""
        latest = self.latest
        for stop in range(self.indexed + 1, end + 1):
            for n in range(1, min(self.max_n, stop) + 1):
                latest[tuple(tokens[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)


def accepted_length(drafts: list[int] | tuple[int, ...], draws: list[int]) -> int:
    """How many leading drafts equal the draws at their positions (the rest are rejected)."""
    accepted = 0
    for draft, draw in zip(drafts, draws):
        if draft != draw:
            break
        accepted += 1
    return accepted


@dataclass
class _DraftState:
    written: int = 0  # positions of the sequence whose keys and values the draft model wrote (its cache)


class DraftModelProposer:
    """A draft model proposing greedily. Its KV cache has the target's block layout, so each sequence's block
    table addresses both; the draft runs after the step is scheduled (its blocks then cover every position it
    writes), in max_draft_len forwards: first the positions it has not seen (a new request's whole prompt, else
    the tokens accepted since its last proposal) ending with the last token, then one position per draft. Its
    cache is valid up to the last position whose token the target kept: the next proposal starts there."""

    def __init__(self, config: DraftTargetDecodingConfig, runner, target_vocab_size: int):
        """runner: the draft model's ModelRunner (engine/model_runner.py), its KV cache allocated."""
        self.max_draft_len = config.max_draft_len
        self.max_concurrency = config.max_concurrency
        self.runner = runner
        self.block_size = runner.block_size
        self.target_vocab_size = target_vocab_size

    def drafts_for(self, running: list[Request], max_seq_len: int) -> dict[int, list[int]] | None:
        """Places for the drafts (placeholders, filled by fill once the step is scheduled), by id(request)."""
        if self.max_concurrency is not None and len(running) > self.max_concurrency:
            return None
        drafts = {}
        for request in running:
            room = draft_room(request, self.max_draft_len, max_seq_len)
            if room:
                drafts[id(request)] = [PLACEHOLDER] * room
        return drafts

    @torch.inference_mode()
    def fill(self, out: SchedulerOutput) -> None:
        """Runs the draft model for the scheduled sequences with drafts and puts its tokens in their places (before
        the step launches: item.start is the sequence's last token, the first position the target computes)."""
        items = [item for item in out.decodes + out.prefills if item.drafts]
        if not items:
            return
        starts = {}
        for item in items:
            state = item.seq.draft_state
            if not isinstance(state, _DraftState):
                state = item.seq.draft_state = _DraftState()
            starts[id(item)] = min(state.written, item.start)
        # What the draft has not seen, through the last token: one-token catch-ups are decode rows and go first.
        items.sort(key=lambda item: item.start != starts[id(item)])
        plan = StepPlan()
        for item in items:
            start = starts[id(item)]
            _append_rows(plan, item.seq.block_ids, item.seq.token_ids[start : item.start + 1], start, self.block_size)
            plan.sample_rows.append(plan.num_tokens - 1)
            item.seq.draft_state.written = item.start + 1
        tokens = self._greedy(plan)
        step = 0
        while True:
            for item, token in zip(items, tokens):
                item.drafts[step] = token
            fed = [(item, token) for item, token in zip(items, tokens) if step + 1 < len(item.drafts)]
            if not fed:
                return
            plan = StepPlan()
            for item, token in fed:  # draft `step` at its position, for the next draft
                _append_rows(plan, item.seq.block_ids, [token], item.start + 1 + step, self.block_size)
                plan.sample_rows.append(plan.num_tokens - 1)
                item.seq.draft_state.written = item.start + 2 + step
            items = [item for item, _ in fed]
            tokens = self._greedy(plan)
            step += 1

    def _greedy(self, plan: StepPlan) -> list[int]:
        hidden = self.runner.forward(plan)
        logits, _ = self.runner.compute_outputs(plan, hidden)
        return logits[:, : self.target_vocab_size].argmax(dim=-1).tolist()


def _append_rows(plan: StepPlan, blocks: list[int], tokens: list[int], start: int, block_size: int) -> None:
    """Adds tokens at positions start.. of a sequence with block table `blocks` to a plan: one token as a decode
    row, more as a prefill chunk (decode rows must all come before the chunks)."""
    span = range(start, start + len(tokens))
    plan.input_ids.extend(tokens)
    plan.positions.extend(span)
    plan.slot_mapping.extend(blocks[pos // block_size] * block_size + pos % block_size for pos in span)
    if len(tokens) == 1:
        plan.decode_contexts.append((blocks, start + 1))
    else:
        plan.prefill_chunks.append((blocks, start, len(tokens)))


def make_proposer(config: NGramDecodingConfig | DraftTargetDecodingConfig | None, draft_runner=None,
                  target_vocab_size: int = 0):
    """The proposer of a speculative_config (None without one); a draft model's needs its runner."""
    if config is None:
        return None
    if config.decoding_type == "NGram":
        return NGramProposer(config)
    if draft_runner is None:
        raise ValueError("DraftTargetDecodingConfig needs the draft model loaded on the engine's first rank")
    return DraftModelProposer(config, draft_runner, target_vocab_size)
