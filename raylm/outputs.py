"""What a request returns: RequestOutput, CompletionOutput and per-token Logprob; EncoderOutput for encode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class Logprob(NamedTuple):
    """Log-probability of one token, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k alternatives).
TokenLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    logprobs_diff: TokenLogprobs = field(default_factory=list)
    # (index of the first token, weight version) per run of tokens that one version of the weights produced: one
    # run, unless generation was paused with mode="keep" across update_weights.
    weight_versions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def weight_version(self) -> int | None:
        """The weight version of the newest token (None before the first)."""
        return self.weight_versions[-1][1] if self.weight_versions else None

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    """The state of a request: its prompt and the sequences generated so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def weight_version(self) -> int | None:
        """The newest weight version that produced any of its tokens (None before the first token)."""
        versions = [output.weight_version for output in self.outputs if output.weight_version is not None]
        return max(versions) if versions else None


@dataclass
class EncoderOutput:
    """What encode returns for one prompt: its embedding, pooled as the engine's PoolingSpec says (a float32 CPU
    tensor of hidden_size values, of unit norm when the pooling normalizes)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: torch.Tensor
    weight_version: int = 0  # the weights that computed it (update_weights bumps the version)

    @property
    def finished(self) -> bool:
        """Always true: an encode request's one output is its last."""
        return True
