"""Beam search over a request's sequences, step by step.

Scoring follows the widely used formulation of HF transformers: each step takes the best
`candidates_per_beam * width` continuations over all beams by summed log-probability; continuations that
end (a stop token, or the length limit) among the best `width` become finished hypotheses scored by
sum / length ** length_penalty; the best `width` that do not end carry on. The search stops when no
running beam can beat the worst kept hypothesis (early_stopping False / 'never'), when `width`
hypotheses are kept (early_stopping True), or when every continuation ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raylm.sampling_params import SamplingParams

_NEG = -1.0e9


def candidates_per_beam(params: SamplingParams) -> int:
    """How many of each beam's best tokens a step needs: enough that width beams survive any stops."""
    return max(2, 1 + len(params.all_stop_token_ids)) * params.beam_width


@dataclass
class Hypothesis:
    output_token_ids: list[int]
    score: float
    cumulative_logprob: float
    token_logprobs: list[float]
    finished_by_stop: bool


@dataclass
class Continuation:
    parent: int  # position of the parent beam in the running list
    token_id: int
    cumulative_logprob: float
    token_logprob: float


@dataclass
class BeamState:
    width: int
    params: SamplingParams
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False

    @property
    def candidates_per_step(self) -> int:
        return candidates_per_beam(self.params)

    def step(
        self,
        beam_outputs: list[list[int]],
        beam_tokens: list[list[tuple[int, float]]],
        beam_scores: list[float],
        beam_token_logprobs: list[list[float]],
    ) -> list[Continuation]:
        """Advances the search by one token.

        beam_outputs[b]: output tokens of running beam b; beam_tokens[b]: its best (token, logprob) pairs;
        beam_scores[b]: its summed log-probability. Returns the continuations to run next (possibly none).
        """
        params = self.params
        stop_ids = params.all_stop_token_ids
        new_length = len(beam_outputs[0]) + 1
        candidates = sorted(
            (
                (score + logprob, beam, token, logprob)
                for beam, (pairs, score) in enumerate(zip(beam_tokens, beam_scores))
                for token, logprob in pairs
            ),
            key=lambda item: -item[0],
        )[: self.candidates_per_step]
        at_limit = new_length >= params.max_tokens
        ends = [at_limit or token in stop_ids for _, _, token, _ in candidates]

        running = [Continuation(beam, token, total, logprob)
                   for (total, beam, token, logprob), ended in zip(candidates, ends) if not ended][: self.width]

        full = len(self.finished) >= self.width
        if self.improvable and not (full and params.early_stopping is True):
            for rank, ((total, beam, token, logprob), ended) in enumerate(zip(candidates, ends)):
                if rank < self.width and ended:
                    self.finished.append(Hypothesis(
                        output_token_ids=beam_outputs[beam] + [token],
                        score=total / (new_length**params.length_penalty),
                        cumulative_logprob=total,
                        token_logprobs=beam_token_logprobs[beam] + [logprob],
                        finished_by_stop=token in stop_ids,
                    ))
            self.finished.sort(key=lambda hyp: -hyp.score)
            del self.finished[self.width :]

        if params.early_stopping == "never" and params.length_penalty > 0.0:
            best_length = params.max_tokens
        else:
            best_length = new_length
        best_running = (running[0].cumulative_logprob if running else _NEG) / (best_length**params.length_penalty)
        worst_finished = self.finished[-1].score if len(self.finished) >= self.width else _NEG
        self.improvable = self.improvable and best_running > worst_finished
        all_kept = len(self.finished) >= self.width and params.early_stopping is True
        self.done = not self.improvable or all_kept or all(ends) or not running
        return [] if self.done else running

    def best(self, count: int) -> list[Hypothesis]:
        return self.finished[:count]
