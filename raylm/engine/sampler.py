"""Turning logits into tokens: penalties, min_tokens, temperature, top-k, top-p, min-p, seeds, logprobs.

Reported log-probabilities are those of the model's raw distribution (before penalties and
temperature), so they compare directly with a reference model. Sampling draws with the exponential
race (argmax of p / E, E ~ Exp(1)), which picks token i with probability p_i and lets each seeded
request draw from its own generator, independent of what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raylm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    num_samples: int = 1
    beam_candidates: int = 0  # > 0: return this many top (token, logprob) pairs for beam search instead


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    beam_ids: list[int] = field(default_factory=list)
    beam_logprobs: list[float] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> None:
    """In place on one row. Repetition penalty over prompt and output; presence/frequency over output."""
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        if seen.numel():
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids = torch.tensor(output_ids, dtype=torch.long, device=device)
        counts = torch.zeros_like(logits).index_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None, min_p: float | None) -> torch.Tensor:
    """Masks (with -inf) the tokens outside the top-k / top-p nucleus / min-p floor of one or more rows."""
    vocab = logits.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and min_p > 0.0:
        probs = logits.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _draw(probs: torch.Tensor, generator: torch.Generator | None, num_samples: int) -> list[int]:
    # Noise comes from the request's CPU generator, so seeded draws are the same on every device.
    noise = torch.empty((num_samples, probs.shape[-1])).exponential_(generator=generator).to(probs.device)
    return (probs.unsqueeze(0) / noise).argmax(dim=-1).tolist()


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """The engine's generator for unseeded rows, on the logits' device (the CPU one on the CPU)."""
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[device]

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        """logits: [len(rows), vocab]. Returns one SampleResult per row."""
        logits = logits.float()
        processed = self._process(logits, rows)
        tokens_per_row: list[list[int]] = [[] for _ in rows]
        greedy = [i for i, row in enumerate(rows) if not row.beam_candidates and row.params.is_greedy]
        if greedy:
            greedy_logits = processed if len(greedy) == len(rows) else processed[greedy]
            for i, token in zip(greedy, greedy_logits.argmax(dim=-1).tolist()):
                tokens_per_row[i] = [token] * rows[i].num_samples
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            params = row.params
            if not row.beam_candidates and not params.is_greedy:
                key = (params.effective_temperature, params.top_k, params.top_p, params.min_p)
                groups.setdefault(key, []).append(i)
        for (temperature, top_k, top_p, min_p), indices in groups.items():
            # Rows with the same sampling settings are filtered together.
            probs = filter_logits(processed[indices] / temperature, top_k, top_p, min_p).softmax(dim=-1)
            shared = []
            for position, i in enumerate(indices):
                row = rows[i]
                if row.generator is not None or row.num_samples > 1:
                    tokens_per_row[i] = _draw(probs[position], row.generator or self.generator, row.num_samples)
                else:
                    shared.append(position)
            if shared:
                chosen = probs[shared]
                noise = torch.empty_like(chosen).exponential_(generator=self._generator_on(chosen.device))
                for position, token in zip(shared, (chosen / noise).argmax(dim=-1).tolist()):
                    tokens_per_row[indices[position]] = [token]
        return self._results(logits, processed, rows, tokens_per_row)

    @staticmethod
    def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logits after penalties and min_tokens masking (the input itself when no row needs either)."""
        processed = None
        for i, row in enumerate(rows):
            params = row.params
            masks_stops = params.min_tokens and len(row.output_token_ids) < params.min_tokens
            if not params.has_penalties and not masks_stops:
                continue
            if processed is None:
                processed = logits.clone()
            if params.has_penalties:
                apply_penalties(processed[i], params, row.prompt_token_ids, row.output_token_ids)
            if masks_stops and params.all_stop_token_ids:
                processed[i, torch.tensor(sorted(params.all_stop_token_ids), dtype=torch.long)] = float("-inf")
        return logits if processed is None else processed

    @staticmethod
    def _results(logits: torch.Tensor, processed: torch.Tensor, rows: list[SamplingRow],
                 tokens_per_row: list[list[int]]) -> list[SampleResult]:
        """Log-probabilities of the raw distribution: logit - logsumexp, without materialising log_softmax."""
        log_normalizer = torch.logsumexp(logits, dim=-1)
        row_index = torch.tensor([i for i, tokens in enumerate(tokens_per_row) for _ in tokens], dtype=torch.long)
        flat_tokens = torch.tensor([token for tokens in tokens_per_row for token in tokens], dtype=torch.long)
        chosen_logits = logits[row_index, flat_tokens]
        chosen_list = (chosen_logits - log_normalizer[row_index]).tolist()
        results = []
        offset = 0
        for i, (row, tokens) in enumerate(zip(rows, tokens_per_row)):
            if row.beam_candidates:
                values, ids = torch.topk(torch.log_softmax(processed[i], dim=-1), row.beam_candidates)
                results.append(SampleResult([], [], [], beam_ids=ids.tolist(), beam_logprobs=values.tolist()))
                continue
            result = SampleResult(tokens, chosen_list[offset : offset + len(tokens)], [])
            if row.params.logprobs is not None:  # ranks and top-k only when asked for
                row_chosen = chosen_logits[offset : offset + len(tokens)]
                result.ranks = ((logits[i].unsqueeze(0) > row_chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
                if row.params.logprobs:
                    values, ids = torch.topk(logits[i], row.params.logprobs)
                    result.top_ids = [ids.tolist()] * len(tokens)
                    result.top_logprobs = [(values - log_normalizer[i]).tolist()] * len(tokens)
            offset += len(tokens)
            results.append(result)
        return results
