"""Messages between the driver and the engine: plain, picklable dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylm.lora_request import LoRARequest
from raylm.sampling_params import SamplingParams

# Per generated token: (logprob, rank, top-k token ids, top-k logprobs). Rank and top-k may be None.
TokenLogprob = tuple[float, "int | None", "list[int] | None", "list[float] | None"]


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: float = 0.5
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


@dataclass
class EncodeRequest:
    """A prompt to encode into one embedding (an encode_only engine's request)."""

    request_id: str
    prompt_token_ids: list[int]


@dataclass
class SequenceDelta:
    """What one sequence produced in one step (or, with replace, its whole output)."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class RequestDelta:
    request_id: str
    sequences: list[SequenceDelta] = field(default_factory=list)
    finished: bool = False
    replace: bool = False  # beam search: sequences carry complete outputs that replace earlier ones
    prompt_logprobs: list[TokenLogprob] | None = None  # for the next prompt positions, in order
    num_cached_tokens: int = 0
    error: str | None = None
    embedding: Any = None  # an encode request's result: a float32 CPU tensor [hidden_size]


@dataclass
class StepOutput:
    """Everything one engine iteration sends to the driver."""

    deltas: list[RequestDelta] = field(default_factory=list)
    stats: dict | None = None
    kv_events: list[dict] = field(default_factory=list)
    fatal_error: str | None = None  # set when the engine has died; every pending request fails
    weight_version: int = 0  # the weights that produced this output's tokens (update_weights bumps it)
