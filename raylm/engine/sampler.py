"""Turning logits into tokens: penalties, min_tokens, temperature, top-k, top-p, min-p, seeds, logprobs.

Reported log-probabilities are those of the model's raw distribution (before penalties and
temperature), so they compare directly with a reference model. Sampling draws with the exponential
race (argmax of p / E, E ~ Exp(1)), which picks token i with probability p_i and lets each seeded
request draw from its own generator, independent of what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from raylm.engine.structured_output import Guide, mask_guided_rows
from raylm.sampling_params import SamplingParams

_EMPTY: list = []  # shared by every SampleResult for what it does not report; never mutated


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    num_samples: int = 1
    beam_candidates: int = 0  # > 0: return this many top (token, logprob) pairs for beam search instead
    guide: Guide | None = None  # structured output: the draw is masked to what the guide allows
    # A speculating guided sequence's first verify row: the next len(drafts) rows are its drafts' positions, masked
    # to what the guide allows after each prefix of the drafts (they carry no guide of their own).
    drafts: tuple[int, ...] = ()


class _RowKinds:
    """What a batch of rows asks of the sampler, found in one pass that reads each distinct SamplingParams once
    (the rows of a batch usually share a few: every request of one generate() call shares one)."""

    __slots__ = ("greedy", "greedy_single", "groups", "processes", "plain", "reports_ranks", "num_top",
                 "has_beams", "identity")

    def __init__(self, rows: list[SamplingRow]):
        self.greedy: list[int] = []  # greedy rows, in order
        self.greedy_single = True  # every greedy row draws once
        self.groups: dict[tuple, list[int]] = {}  # sampled rows by (temperature, top_k, top_p, min_p)
        self.processes = False  # some row needs penalties or min_tokens masking
        self.plain = True  # one draw per row, nothing reported but its log-probability
        self.reports_ranks = False
        self.num_top = 0
        self.has_beams = False
        facts: dict[int, tuple] = {}
        for i, row in enumerate(rows):
            params = row.params
            known = facts.get(id(params))
            if known is None:
                known = facts[id(params)] = (
                    params.is_greedy, params.has_penalties or bool(params.min_tokens), params.logprobs,
                    (params.effective_temperature, params.top_k, params.top_p, params.min_p))
            is_greedy, processes, logprobs, key = known
            if processes or (row.guide is not None and (row.guide.active or row.drafts)):
                self.processes = True
            if row.beam_candidates:
                self.has_beams = True
                self.plain = False
                continue
            if logprobs is not None:
                self.plain = False
                self.reports_ranks = True
                self.num_top = max(self.num_top, logprobs)
            if row.num_samples != 1:
                self.plain = False
            if is_greedy:
                self.greedy.append(i)
                if row.num_samples != 1:
                    self.greedy_single = False
            else:
                self.groups.setdefault(key, []).append(i)
        self.identity = self.greedy_single and len(self.greedy) == len(rows)  # entry i of the draws is row i's


class SampleResult:
    """One row's draws: token ids and their log-probabilities, with ranks and top-k alternatives when asked
    for, or the beam candidates. Read-only: the absent parts share one empty list (one result is made per
    sequence per step, so it is kept cheap)."""

    __slots__ = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "beam_ids", "beam_logprobs")

    def __init__(self, token_ids: list[int], logprobs: list[float], ranks: list[int],
                 top_ids: list[list[int]] = _EMPTY, top_logprobs: list[list[float]] = _EMPTY,
                 beam_ids: list[int] = _EMPTY, beam_logprobs: list[float] = _EMPTY):
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.ranks = ranks
        self.top_ids = top_ids
        self.top_logprobs = top_logprobs
        self.beam_ids = beam_ids
        self.beam_logprobs = beam_logprobs

    def __repr__(self) -> str:
        return "SampleResult(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> None:
    """In place on one row. Repetition penalty over prompt and output; presence/frequency over output."""
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = to_device(sorted(set(prompt_ids) | set(output_ids)), device)
        if seen.numel():
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids = to_device(output_ids, device)
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


def greedy_draws(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token and its log-probability under the raw distribution: the sampler's draws for a
    batch of plain greedy rows, which a decode CUDA graph computes for a step of greedy requests."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None, num_samples: int) -> torch.Tensor:
    # Noise comes from the request's CPU generator, so seeded draws are the same on every device.
    noise = torch.empty((num_samples, probs.shape[-1])).exponential_(generator=generator)
    return (probs.unsqueeze(0) / _to_device(noise, probs.device)).argmax(dim=-1)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device's queued work (the copy is queued too)."""
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of `values` on `device`, copied without waiting for the device's queued work. Built through
    NumPy: a few times quicker than torch.tensor(list) for the index lists of a step."""
    return _to_device(torch.from_numpy(np.array(values, dtype=np.int64)), device)


def row_index(rows: list[int], device: torch.device) -> torch.Tensor | int:
    """Rows of a tensor to take or fill: their count when they are the leading ones in order (0, 1, ..., n - 1:
    a slice, with no index to copy to the device, as in a step that feeds every row of the one before), else
    their index on `device`."""
    if rows[-1] == len(rows) - 1 and rows == list(range(len(rows))):
        return len(rows)
    return to_device(rows, device)


def take_rows(tensor: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """tensor's rows at a row_index."""
    return tensor[:index] if isinstance(index, int) else tensor[index]


def put_rows(tensor: torch.Tensor, index: torch.Tensor | int, values: torch.Tensor) -> None:
    """Writes values into tensor's rows at a row_index, in place."""
    if isinstance(index, int):
        tensor[:index].copy_(values)
    else:
        tensor.index_copy_(0, index, values)



def merge_draws(results: list[SampleResult]) -> SampleResult:
    """Single draws of consecutive positions as one result with a draw per position (speculative decoding)."""
    merged = SampleResult([r.token_ids[0] for r in results], [r.logprobs[0] for r in results],
                          [r.ranks[0] for r in results] if results[0].ranks else _EMPTY)
    if results[0].top_ids:
        merged.top_ids = [r.top_ids[0] for r in results]
        merged.top_logprobs = [r.top_logprobs[0] for r in results]
    return merged


class PendingSamples:
    """A batch of draws still on the device: their copy to the host is queued behind the step that produced
    them. `tokens` (in draw order, one entry per sample) can feed the next step before the copy completes;
    results() waits for the copy and returns one SampleResult per row."""

    def __init__(self, rows: list[SamplingRow], entries: list[list[int]], tokens: torch.Tensor,
                 device_parts: dict[str, torch.Tensor], plain: bool, precomputed: bool = False):
        self.rows = rows
        self.entries = entries  # per row: positions of its samples in `tokens`
        self.plain = plain  # one draw per row and nothing reported but its log-probability
        self.precomputed = precomputed  # the greedy draws a decode graph computed (Sampler.sample's `greedy`)
        self.tokens = tokens
        self._host: dict[str, torch.Tensor] = {}
        self._event = None
        pin = tokens.device.type == "cuda"
        for name, tensor in {"tokens": tokens, **device_parts}.items():
            if pin:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
            else:
                host = tensor
            self._host[name] = host
        if pin:
            self._event = torch.cuda.Event()
            self._event.record()

    def results(self) -> list[SampleResult]:
        if self._event is not None:
            self._event.synchronize()
        host = {name: tensor.tolist() for name, tensor in self._host.items()}
        tokens, chosen = host["tokens"], host.get("chosen", [])
        if self.plain:
            return [SampleResult([tokens[entry]], [chosen[entry]], _EMPTY) for [entry] in self.entries]
        ranks = host.get("ranks")
        results = []
        for i, (row, entries) in enumerate(zip(self.rows, self.entries)):
            if row.beam_candidates:
                results.append(SampleResult([], [], [], beam_ids=host[f"beam_ids{i}"],
                                            beam_logprobs=host[f"beam_logprobs{i}"]))
                continue
            result = SampleResult([tokens[e] for e in entries], [chosen[e] for e in entries], [])
            if row.params.logprobs is not None:
                result.ranks = [ranks[e] for e in entries]
                if row.params.logprobs:
                    k = row.params.logprobs
                    result.top_ids = [host["top_ids"][i][:k]] * len(entries)
                    result.top_logprobs = [host["top_logprobs"][i][:k]] * len(entries)
            results.append(result)
        return results


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
        return self.sample(logits, rows).results()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> PendingSamples:
        """Draws on the logits' device without waiting for it; the results come from the returned batch.
        greedy: greedy_draws(logits), already queued (by a decode graph), which a batch of plain greedy rows
        takes instead of launching its own."""
        kinds = _RowKinds(rows)
        if kinds.identity and kinds.plain and not kinds.processes:  # plain greedy rows: one draw each
            tokens, chosen = greedy if greedy is not None else greedy_draws(logits)
            return PendingSamples(rows, [[i] for i in range(len(rows))], tokens, {"chosen": chosen}, True,
                                  precomputed=greedy is not None)
        logits = logits.float()
        device = logits.device
        processed = self._process(logits, rows) if kinds.processes else logits
        parts: list[torch.Tensor] = []  # token tensors, concatenated in this order
        owners: list[int] = []  # the row of each entry of the concatenation
        greedy = kinds.greedy
        if greedy:
            greedy_logits = processed if len(greedy) == len(rows) else processed[to_device(greedy, device)]
            argmax = greedy_logits.argmax(dim=-1)
            if kinds.greedy_single:
                parts.append(argmax)
                owners.extend(greedy)
            else:
                parts.extend(argmax[position : position + 1].expand(rows[i].num_samples)
                             for position, i in enumerate(greedy))
                for i in greedy:
                    owners.extend([i] * rows[i].num_samples)
        for (temperature, top_k, top_p, min_p), indices in kinds.groups.items():
            # Rows with the same sampling settings are filtered together.
            selected = processed if len(indices) == len(rows) else processed[to_device(indices, device)]
            probs = filter_logits(selected / temperature, top_k, top_p, min_p).softmax(dim=-1)
            shared = []
            for position, i in enumerate(indices):
                row = rows[i]
                if row.generator is not None or row.num_samples > 1:
                    parts.append(_draw(probs[position], row.generator or self.generator, row.num_samples))
                    owners.extend([i] * row.num_samples)
                else:
                    shared.append(position)
            if shared:
                chosen = probs if len(shared) == len(indices) else probs[to_device(shared, device)]
                noise = torch.empty_like(chosen).exponential_(generator=self._generator_on(device))
                parts.append((chosen / noise).argmax(dim=-1))
                owners.extend(indices[position] for position in shared)
        if kinds.identity:
            entries = [[i] for i in range(len(rows))]
        else:
            entries = [[] for _ in rows]
            for entry, i in enumerate(owners):
                entries[i].append(entry)
        if not parts:
            tokens = torch.empty(0, dtype=torch.long, device=device)
        else:
            tokens = parts[0] if len(parts) == 1 else torch.cat(parts)
        report = self._report(logits, processed, rows, owners, tokens, kinds)
        return PendingSamples(rows, entries, tokens, report, kinds.plain)

    @staticmethod
    def _report(logits: torch.Tensor, processed: torch.Tensor, rows: list[SamplingRow], owners: list[int],
                tokens: torch.Tensor, kinds: _RowKinds) -> dict[str, torch.Tensor]:
        """Device tensors of what the results report. Log-probabilities are those of the raw distribution:
        logit - logsumexp, without materialising log_softmax."""
        report: dict[str, torch.Tensor] = {}
        device = logits.device
        if owners:
            log_normalizer = torch.logsumexp(logits, dim=-1)
            if kinds.identity or owners == list(range(len(rows))):
                row_logits, row_normalizer = logits, log_normalizer
            else:
                owner_index = to_device(owners, device)
                row_logits, row_normalizer = logits[owner_index], log_normalizer[owner_index]
            chosen_logits = row_logits.gather(1, tokens[:, None]).squeeze(1)
            report["chosen"] = chosen_logits - row_normalizer
            if kinds.reports_ranks:
                report["ranks"] = (row_logits > chosen_logits[:, None]).sum(dim=-1) + 1
            if kinds.num_top:
                values, ids = torch.topk(logits, kinds.num_top, dim=-1)
                report["top_ids"] = ids
                report["top_logprobs"] = values - log_normalizer[:, None]
        if kinds.has_beams:
            for i, row in enumerate(rows):
                if row.beam_candidates:
                    values, ids = torch.topk(torch.log_softmax(processed[i], dim=-1), row.beam_candidates)
                    report[f"beam_ids{i}"] = ids
                    report[f"beam_logprobs{i}"] = values
        return report

    @staticmethod
    def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logits after penalties, min_tokens masking and structured output's masks (the input itself when no
        row needs any)."""
        processed = None
        guided = [(i, row.guide, row.drafts) for i, row in enumerate(rows)
                  if row.guide is not None and (row.guide.active or row.drafts)]
        if guided:
            processed = logits.clone()
            mask_guided_rows(processed, guided)
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
                processed[i, to_device(sorted(params.all_stop_token_ids), logits.device)] = float("-inf")
        return logits if processed is None else processed
