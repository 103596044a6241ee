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

from raylm.config import NGramDecodingConfig
from raylm.engine.request import PLACEHOLDER, Request, Sequence
from raylm.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's draws can be verified position by position: one sequence, no beam search, and nothing
    that makes a position's distribution depend on the tokens drawn before it in the same step (penalties,
    min_tokens, a grammar)."""
    return (params.use_speculative_decoding and params.num_sequences == 1 and not params.use_beam_search
            and not params.has_penalties and not params.min_tokens and params.guided_decoding is None)


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
        """Drafts for the running requests that speculate, by id(request): each a sequence whose last token is
        known and uncomputed, proposing at most what its max_tokens and max_seq_len leave after the step's own
        token. None when more requests run than max_concurrency."""
        if self.max_concurrency is not None and len(running) > self.max_concurrency:
            return None
        drafts: dict[int, list[int]] = {}
        for request in running:
            if not request.speculates:
                continue
            seq = request.sequences[0]
            length = len(seq.token_ids)
            if seq.finish_reason is not None or length - seq.num_computed_tokens != 1:
                continue
            if seq.token_ids[-1] == PLACEHOLDER:
                continue
            room = min(self.max_draft_len, request.sampling_params.max_tokens - seq.num_output_tokens - 1,
                       max_seq_len - length - 1)
            if room > 0:
                proposal = self.propose(seq, room)
                if proposal:
                    drafts[id(request)] = proposal
        return drafts


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
