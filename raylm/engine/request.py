"""Request state inside the engine. Requests carry state; the scheduler and the KV cache manager act on it.

A request holds one or more sequences: one while its prompt is prefilled, then `best_of` (or the beam
width) after the first token, all sharing the prompt's KV blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from raylm.engine.beam_search import candidates_per_beam
from raylm.engine.sampler import SamplingRow
from raylm.engine.structured_output import Guide
from raylm.lora_request import LoRARequest
from raylm.sampling_params import SamplingParams

# The token id at a position whose token a step still in flight is sampling (overlapped scheduling).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class Sequence:
    """One token sequence: the prompt plus what it generated, and the cache blocks holding its keys."""

    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    # Only ever appended to; any other change assigns a new list (holders of a copy, like the decode graphs'
    # block-table staging, tell that it changed by its identity and length alone).
    block_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    generator: torch.Generator | None = None
    # Prefix-cache cursor: blocks of this sequence already keyed, and the key of the last one.
    num_hashed_blocks: int = 0
    last_block_hash: int | None = None
    # Per-token (token logprob, rank, top-k ids, top-k logprobs), kept for beam search outputs only.
    logprob_history: list[tuple] = field(default_factory=list)
    # The sampler's view of this sequence when it never changes between steps (Request.sampling_row).
    sampling_row: SamplingRow | None = None
    # Its place in the request's grammar (structured output), advanced by each token it accepts.
    guide: Guide | None = None
    # Speculative decoding's proposer's index of this sequence's tokens (engine/speculative.py).
    draft_state: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known: all but the trailing placeholders (two at most: the draws of the step
        in flight and of the one queued after it)."""
        known = len(self.token_ids)
        while known and self.token_ids[known - 1] == PLACEHOLDER:
            known -= 1
        return known

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def reset_for_recompute(self) -> None:
        """After preemption: no blocks, nothing computed; the whole sequence is computed again."""
        self.block_ids = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.last_block_hash = None
        self.draft_state = None  # a draft model's cache of it is gone with its blocks

    def fork(self, index: int, generator: torch.Generator | None) -> Sequence:
        """A copy sharing history (the caller shares the blocks through reference counts)."""
        return Sequence(
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.num_computed_tokens,
            block_ids=list(self.block_ids),
            cumulative_logprob=self.cumulative_logprob,
            generator=generator,
            num_hashed_blocks=self.num_hashed_blocks,
            last_block_hash=self.last_block_hash,
            logprob_history=list(self.logprob_history),
            guide=self.guide.fork() if self.guide is not None else None,
        )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: float = 0.5
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    sequences: list[Sequence] = field(default_factory=list)
    prompt_block_hashes: list[int] = field(default_factory=list)
    # Where its block-hash chains start: the root of the weight version when it came in and of its adapter
    # (kv_cache.hash_chain_root).
    hash_root: int | None = None
    lora_request: LoRARequest | None = None  # the LoRA adapter it generates with, or None: the base model
    lora_slot: int = -1  # the device slot holding its adapter while it runs (engine/lora_slots.py); -1: none
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    forked: bool = False
    beam_state: object | None = None
    first_scheduled_time: float | None = None
    prompt_logprobs_next: int = 1  # next prompt position whose log-probability is still to be reported
    stop_ids: frozenset[int] = frozenset()
    grammar: object | None = None  # structured output: the Future of its compiled grammar (EngineCore)
    # Whether a step of this request may be queued before its previous draw reaches the host, once it has
    # forked (see Progress.launched): no penalties (they read output tokens) and no beam search.
    plain_draws: bool = True
    # Whether each of its steps draws the greedy token and reports nothing but its log-probability (what a decode
    # graph can compute for a step of such requests: sampler.greedy_draws).
    greedy_draws: bool = False
    # Whether its steps may carry draft tokens to verify (engine/speculative.py), set by the engine.
    speculates: bool = False

    def __post_init__(self) -> None:
        params = self.sampling_params
        self.stop_ids = params.all_stop_token_ids
        # A guided draw's mask needs the sequence's previous token on the host.
        self.plain_draws = not (params.use_beam_search or params.has_penalties or params.guided_decoding)
        self.greedy_draws = (self.plain_draws and params.is_greedy and params.logprobs is None
                             and not params.min_tokens and params.num_sequences == 1)
        if not self.sequences:
            generator = None
            if self.sampling_params.seed is not None:
                generator = torch.Generator().manual_seed(self.sampling_params.seed)
            self.sequences.append(Sequence(0, list(self.prompt_token_ids), len(self.prompt_token_ids),
                                           generator=generator))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def live_sequences(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.finished]

    @property
    def is_beam_search(self) -> bool:
        return self.sampling_params.use_beam_search

    @property
    def awaits_draw(self) -> bool:
        """Whether a sequence's last token is a placeholder: a draw of a step still in flight."""
        return any(seq.token_ids and seq.token_ids[-1] == PLACEHOLDER for seq in self.sequences)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        """The sampler's view of `seq` for its next draw. Kept on the sequence where nothing in it changes while the
        sequence runs (plain draws, no min_tokens, one sample a row): made once, not every step."""
        row = seq.sampling_row
        if row is not None:
            return row
        params = self.sampling_params
        # The sampler reads output tokens for penalties and min_tokens only; min_tokens only counts them.
        output = seq.output_token_ids if params.min_tokens or not self.plain_draws else ()
        num_samples = params.num_sequences if not self.is_beam_search and not self.forked else 1
        beam_candidates = candidates_per_beam(params) if self.is_beam_search else 0
        row = SamplingRow(params, self.prompt_token_ids, output, seq.generator, num_samples, beam_candidates,
                          seq.guide)
        if self.plain_draws and not params.min_tokens and num_samples == 1:
            seq.sampling_row = row
        return row

    def sort_key(self) -> tuple[float, float]:
        """Scheduling order: higher priority first, then first come first served."""
        return (-self.priority, self.arrival_time)
