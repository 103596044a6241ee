"""The model runner: owns the device tensors (weights, KV cache), turns a schedule into a forward pass,
and calls the sampler on the rows that need a token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raylm.engine.beam_search import candidates_per_beam
from raylm.engine.messages import TokenLogprob
from raylm.engine.sampler import Sampler, SampleResult, SamplingRow
from raylm.engine.scheduler import ScheduledSequence, SchedulerOutput
from raylm.kernels.attention import build_metadata
from raylm.models.arch import ArchConfig

# Prompt log-probabilities are computed this many positions at a time, to bound the logits' memory.
_PROMPT_LOGPROB_ROWS = 256


@dataclass
class ModelOutput:
    samples: list[SampleResult | None]  # aligned with SchedulerOutput.scheduled
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


def _sampling_row(item: ScheduledSequence) -> SamplingRow:
    request, seq = item.request, item.seq
    params = request.sampling_params
    row = SamplingRow(params, request.prompt_token_ids, seq.output_token_ids, seq.generator)
    if request.is_beam_search:
        row.beam_candidates = candidates_per_beam(params)
    elif not request.forked and params.num_sequences > 1:
        row.num_samples = params.num_sequences
    return row


def _logprob_entries(logprobs: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        tops = zip(ids.tolist(), values.tolist())
    else:
        tops = ((None, None) for _ in chosen_list)
    return [(lp, rank, top_ids, top_lps) for lp, rank, (top_ids, top_lps) in zip(chosen_list, rank_list, tops)]


class ModelRunner:
    def __init__(self, model: nn.Module, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 block_size: int, seed: int = 0):
        self.model = model
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_heads = model.layers[0].self_attn.num_kv_heads

    # ------------------------------------------------------------------ KV cache

    def kv_bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=kv_dtype).element_size()
        return 2 * self.arch.num_layers * self.block_size * self.num_kv_heads * self.arch.head_dim * element

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """num_blocks usable blocks plus the null block 0, which alone is zeroed: every other slot is
        written before attention reads it, so the rest is left uninitialised (and untouched on the CPU)."""
        shape = (num_blocks + 1, self.block_size, self.num_kv_heads, self.arch.head_dim)
        self.kv_caches = []
        for _ in range(self.arch.num_layers):
            k_cache = torch.empty(shape, dtype=kv_dtype, device=self.device)
            v_cache = torch.empty(shape, dtype=kv_dtype, device=self.device)
            k_cache[0].zero_()
            v_cache[0].zero_()
            self.kv_caches.append((k_cache, v_cache))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        sources = torch.tensor([src for src, _ in copies], device=self.device)
        targets = torch.tensor([dst for _, dst in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[targets] = k_cache[sources]
            v_cache[targets] = v_cache[sources]

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        self._copy_blocks(out.block_copies)
        scheduled = out.scheduled
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        bs = self.block_size
        for item in scheduled:
            input_ids.extend(item.token_ids)
            span = range(item.start, item.start + item.num_tokens)
            positions.extend(span)
            blocks = item.seq.block_ids
            slot_mapping.extend(blocks[pos // bs] * bs + pos % bs for pos in span)
        meta = build_metadata(
            decode_contexts=[(item.seq.block_ids, item.start + 1) for item in out.decodes],
            prefill_chunks=[(item.seq.block_ids, item.start, item.num_tokens) for item in out.prefills],
            slot_mapping=slot_mapping,
            block_size=bs,
            sliding_window=self.arch.sliding_window,
            device=self.device,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
        )
        return ModelOutput(self._sample(scheduled, hidden), self._prompt_logprobs(scheduled, hidden))

    def _sample(self, scheduled: list[ScheduledSequence], hidden: torch.Tensor) -> list[SampleResult | None]:
        rows, row_items, offset = [], [], 0
        for position, item in enumerate(scheduled):
            offset += item.num_tokens
            if item.completes:
                rows.append(offset - 1)
                row_items.append(position)
        samples: list[SampleResult | None] = [None] * len(scheduled)
        if not rows:
            return samples
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        results = self.sampler(logits, [_sampling_row(scheduled[i]) for i in row_items])
        for position, result in zip(row_items, results):
            samples[position] = result
        return samples

    def _prompt_logprobs(self, scheduled: list[ScheduledSequence], hidden: torch.Tensor
                         ) -> dict[str, list[TokenLogprob]]:
        """Log-probabilities of prompt tokens: position p's logits score prompt token p + 1."""
        found: dict[str, list[TokenLogprob]] = {}
        offset = 0
        for item in scheduled:
            request = item.request
            first_row = offset
            offset += item.num_tokens
            if not request.wants_prompt_logprobs or request.forked:
                continue
            last_target = min(item.start + item.num_tokens, request.num_prompt_tokens - 1)
            first_target = max(item.start + 1, request.prompt_logprobs_next)
            if first_target > last_target:
                continue
            num_top = request.sampling_params.prompt_logprobs or 0
            entries: list[TokenLogprob] = []
            for chunk_start in range(first_target, last_target + 1, _PROMPT_LOGPROB_ROWS):
                chunk_end = min(chunk_start + _PROMPT_LOGPROB_ROWS, last_target + 1)
                rows = torch.arange(chunk_start - 1, chunk_end - 1, device=self.device) - item.start + first_row
                logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
                targets = torch.tensor(request.prompt_token_ids[chunk_start:chunk_end], device=self.device)
                entries.extend(_logprob_entries(logprobs, targets, num_top))
            request.prompt_logprobs_next = last_target + 1
            found[request.request_id] = entries
        return found
