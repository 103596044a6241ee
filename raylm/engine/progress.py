"""Applying a step's results to requests: computed tokens, sampled tokens, forks, beams and stops.

Produces the per-request deltas the driver turns into outputs.
"""

from __future__ import annotations

import torch

from raylm.engine.beam_search import BeamState
from raylm.engine.messages import RequestDelta, SequenceDelta, TokenLogprob
from raylm.engine.request import PLACEHOLDER, FinishReason, Request, RequestStatus, Sequence
from raylm.engine.sampler import SampleResult
from raylm.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from raylm.engine.speculative import accepted_length
from raylm.engine.step_plan import prompt_logprob_targets


def _child_generator(request: Request, index: int) -> torch.Generator | None:
    seed = request.sampling_params.seed
    # Kept within the generator's 64-bit seeds, which any seed SamplingParams accepts times 1_000_003 is not.
    return None if seed is None else torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**64)


def _check_stop(request: Request, seq: Sequence, max_seq_len: int, position: int) -> None:
    """Whether the token just placed at `position` ends seq; a placeholder after it is then dropped."""
    params = request.sampling_params
    token = seq.token_ids[position]
    length = position + 1
    if token in request.stop_ids:
        seq.finish_reason = FinishReason.STOP
        seq.stop_reason = token if token in params.stop_token_ids else None
    elif length - seq.num_prompt_tokens >= params.max_tokens or length >= max_seq_len:
        seq.finish_reason = FinishReason.LENGTH
    if seq.finish_reason is not None:
        del seq.token_ids[length:]


def _token_logprob(result: SampleResult, draw: int) -> TokenLogprob:
    """What a delta reports of draw number `draw` of result: its log-probability, rank and top alternatives."""
    return (result.logprobs[draw], result.ranks[draw] if result.ranks else None,
            result.top_ids[draw] if result.top_ids else None,
            result.top_logprobs[draw] if result.top_logprobs else None)


def overlap_safe(request: Request) -> bool:
    """Whether the request's next step can be scheduled before its current draw reaches the host: its
    sampling needs no output token ids (penalties), its draw does not fork it (several sequences) and no
    beam search reorders its sequences. (A grammar's mask needs the token too, but only when the next step
    draws: the runner then draws that step once the token is in, ModelRunner.launch_planned.)"""
    params = request.sampling_params
    return (not (params.use_beam_search or params.has_penalties)
            and (request.forked or params.num_sequences == 1))


class Progress:
    """Moves requests forward after each model step."""

    def __init__(self, scheduler: Scheduler, max_seq_len: int):
        self.scheduler = scheduler
        self.kv_cache = scheduler.kv_cache
        self.max_seq_len = max_seq_len
        # Speculative decoding: while on, speculating requests get no placeholders (their next proposal needs their
        # tokens on the host); draft tokens checked and accepted so far, and in the last step applied.
        self.speculating = False
        self.num_draft_tokens = 0
        self.num_accepted_drafts = 0
        self.step_drafts = (0, 0, 0)  # (requests with drafts, drafts, accepted) of the last apply

    def launched(self, out: SchedulerOutput, placeholders: bool) -> bool:
        """A step was queued: its tokens count as computed, so the next schedule moves past them. With
        `placeholders`, each sequence that draws a token and is overlap_safe gets a placeholder for it, so that
        its next step can be scheduled before the draw arrives. Returns whether every drawing sequence got one
        (then the next step may be scheduled before this one's results are applied)."""
        every = True
        speculating = self.speculating
        for item in out.scheduled:
            seq = item.seq
            if item.request.wants_prompt_logprobs:  # this step reports these positions (step_plan.py)
                targets = prompt_logprob_targets(item)
                if targets is not None:
                    item.request.prompt_logprobs_next = targets[1] + 1
            seq.num_computed_tokens += item.num_tokens
            if item.completes:
                if (placeholders and overlap_safe(item.request) and not item.drafts
                        and not (speculating and item.request.speculates)):
                    seq.token_ids.append(PLACEHOLDER)
                    item.placeholder = True
                else:
                    every = False
        return every

    def apply(
        self,
        out: SchedulerOutput,
        samples: list[SampleResult | None],
        prompt_logprobs: dict[str, list[TokenLogprob]],
    ) -> list[RequestDelta]:
        """A launched step's results; samples is aligned with out.scheduled (None where a sequence was not
        sampled). Sequences that ended while the step was in flight (a stop, an abort) are passed over."""
        deltas: dict[str, RequestDelta] = {}
        if prompt_logprobs:
            live = {item.request.request_id for item in out.scheduled if not item.request.is_finished}
            for request_id, entries in prompt_logprobs.items():
                if request_id in live:
                    deltas[request_id] = RequestDelta(request_id, prompt_logprobs=entries)
        sampled: dict[str, tuple[Request, list[tuple[ScheduledSequence, SampleResult]]]] = {}
        register = self.kv_cache.register_full_blocks
        drafted = [0, 0, 0]
        for item, result in zip(out.scheduled, samples):
            seq, request = item.seq, item.request
            if seq.finish_reason is not None or request.status is RequestStatus.FINISHED:
                continue
            if item.drafts:
                drafted[0] += 1
                drafted[1] += len(item.drafts)
                drafted[2] += self._apply_drafted(request, item, result, deltas)
                continue
            if not item.placeholder:  # a placeholder's block is keyed once its token is in place
                register(request, seq)
            if result is None:
                continue
            if len(request.sequences) == 1 and not request.is_beam_search:  # the common case, kept cheap
                request_id = request.request_id
                delta = deltas.get(request_id)
                if delta is None:
                    delta = deltas[request_id] = RequestDelta(request_id)
                delta.num_cached_tokens = request.num_cached_tokens
                self._append_samples(request, item, result, delta)  # may fork the request (n > 1)
                ended = seq.finish_reason is not None if len(request.sequences) == 1 else not request.live_sequences
                if ended:
                    self.scheduler.finish_request(request)
                    delta.finished = True
            else:
                sampled.setdefault(request.request_id, (request, []))[1].append((item, result))
        for request_id, (request, items) in sampled.items():
            delta = deltas.setdefault(request_id, RequestDelta(request_id))
            delta.num_cached_tokens = request.num_cached_tokens
            if request.is_beam_search:
                self._beam_step(request, items, delta)
            else:
                for item, result in items:
                    self._append_samples(request, item, result, delta)
            if not request.live_sequences:
                self.scheduler.finish_request(request)
                delta.finished = True
        self.step_drafts = tuple(drafted)
        self.num_draft_tokens += drafted[1]
        self.num_accepted_drafts += drafted[2]
        return list(deltas.values())

    def _apply_drafted(self, request: Request, item: ScheduledSequence, result: SampleResult,
                       deltas: dict[str, RequestDelta]) -> int:
        """A step that computed a sequence's last token and drafts (engine/speculative.py): the drafts equal to
        the draws at their positions are kept, then the first draw that differs (or the one after the last
        draft); the positions of rejected drafts stop counting as computed. Each kept token is checked for a stop
        as a decode's is. Returns how many drafts were accepted."""
        seq, drafts, draws = item.seq, item.drafts, result.token_ids
        accepted = accepted_length(drafts, draws)
        seq.num_computed_tokens -= len(drafts) - accepted
        delta = deltas.get(request.request_id)
        if delta is None:
            delta = deltas[request.request_id] = RequestDelta(request.request_id)
        delta.num_cached_tokens = request.num_cached_tokens
        wants_logprobs = request.sampling_params.logprobs is not None
        new_tokens: list[int] = []
        new_logprobs: list[TokenLogprob] | None = [] if wants_logprobs else None
        for draw in range(accepted + 1):
            token = draws[draw]
            seq.token_ids.append(token)
            if seq.guide is not None:
                seq.guide.accept(token)
            new_tokens.append(token)
            seq.cumulative_logprob += result.logprobs[draw]
            if wants_logprobs:
                new_logprobs.append(_token_logprob(result, draw))
            _check_stop(request, seq, self.max_seq_len, len(seq.token_ids) - 1)
            if seq.finish_reason is not None:
                break
        finish_reason = seq.finish_reason
        delta.sequences.append(SequenceDelta(
            seq.index, new_tokens, new_logprobs, seq.cumulative_logprob,
            finish_reason.value if finish_reason is not None else None, seq.stop_reason))
        if finish_reason is not None:
            self.scheduler.finish_request(request)
            delta.finished = True
        else:
            self.kv_cache.register_full_blocks(request, seq)
        return accepted

    # ------------------------------------------------------------------ sampling and parallel samples

    def _append_samples(self, request: Request, item: ScheduledSequence, result: SampleResult,
                        delta: RequestDelta) -> None:
        seq, tokens = item.seq, result.token_ids
        if item.placeholder:  # one draw, in place of the placeholder put there at launch
            position = item.start + item.num_tokens
            seq.token_ids[position] = tokens[0]
            if seq.guide is not None:
                seq.guide.accept(tokens[0])
            self.kv_cache.register_full_blocks(request, seq)
            self._report(request, seq, result, 0, position, delta)
            return
        targets = [seq]
        if len(tokens) > 1:  # first token of a request with several sequences: fork the prompt
            request.forked = True
            for index in range(1, len(tokens)):
                child = seq.fork(index, _child_generator(request, index))
                self.kv_cache.fork(seq, child)
                request.sequences.append(child)
                targets.append(child)
        for draw, target in enumerate(targets):
            target.token_ids.append(tokens[draw])
            if target.guide is not None:
                target.guide.accept(tokens[draw])
            self._report(request, target, result, draw, target.num_tokens - 1, delta)

    def _report(self, request: Request, seq: Sequence, result: SampleResult, draw: int, position: int,
                delta: RequestDelta) -> None:
        """Accounts draw number `draw` of result, placed at seq.token_ids[position]: stop, free, delta."""
        seq.cumulative_logprob += result.logprobs[draw]
        _check_stop(request, seq, self.max_seq_len, position)
        finish_reason = seq.finish_reason
        if finish_reason is not None:
            self.kv_cache.free(seq)
        new_logprobs = None
        if request.sampling_params.logprobs is not None:
            new_logprobs = [_token_logprob(result, draw)]
        delta.sequences.append(SequenceDelta(
            seq.index, [seq.token_ids[position]], new_logprobs, seq.cumulative_logprob,
            finish_reason.value if finish_reason is not None else None, seq.stop_reason,
        ))

    # ------------------------------------------------------------------ beam search

    def _beam_step(self, request: Request, items: list[tuple[ScheduledSequence, SampleResult]],
                   delta: RequestDelta) -> None:
        params = request.sampling_params
        if request.beam_state is None:
            request.beam_state = BeamState(params.beam_width, params)
        state: BeamState = request.beam_state
        beams = [item.seq for item, _ in items]
        results = [result for _, result in items]
        continuations = state.step(
            beam_outputs=[seq.output_token_ids for seq in beams],
            beam_tokens=[list(zip(r.beam_ids, r.beam_logprobs)) for r in results],
            beam_scores=[seq.cumulative_logprob for seq in beams],
            beam_token_logprobs=[list(seq.logprob_history) for seq in beams],
        )
        if state.done:
            for seq in request.sequences:
                seq.finish_reason = seq.finish_reason or FinishReason.STOP
            delta.replace = True
            for index, hyp in enumerate(state.best(params.n)):
                delta.sequences.append(SequenceDelta(
                    index=index,
                    new_token_ids=hyp.output_token_ids,
                    new_logprobs=[(lp, None, None, None) for lp in hyp.token_logprobs]
                    if params.logprobs is not None else None,
                    cumulative_logprob=hyp.cumulative_logprob,
                    finish_reason=(FinishReason.STOP if hyp.finished_by_stop else FinishReason.LENGTH).value,
                    stop_reason=hyp.output_token_ids[-1]
                    if hyp.finished_by_stop and hyp.output_token_ids[-1] in params.stop_token_ids else None,
                ))
            return
        request.forked = True
        reused: set[int] = set()
        next_beams: list[Sequence] = []
        for cont in continuations:
            parent = beams[cont.parent]
            if cont.parent not in reused:
                reused.add(cont.parent)
                next_beams.append(parent)
            else:
                child = parent.fork(len(next_beams), None)
                self.kv_cache.fork(parent, child)
                next_beams.append(child)
        for position, seq in enumerate(beams):
            if position not in reused:
                self.kv_cache.free(seq)
        for index, (seq, cont) in enumerate(zip(next_beams, continuations)):
            seq.index = index
            seq.token_ids.append(cont.token_id)
            seq.cumulative_logprob = cont.cumulative_logprob
            seq.logprob_history.append(cont.token_logprob)
        request.sequences = next_beams
