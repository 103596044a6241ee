"""The model runner: owns the device tensors (weights, KV cache), turns a schedule into a forward pass,
and calls the sampler on the rows that need a token. It is the engine's StepRunner on one device.

A step is described by a StepPlan (engine/step_plan.py), plain data that every rank of a multi-rank engine
receives: each rank runs `forward` on its shard or stage, the last stage computes the logits the plan asks for,
and rank 0 samples. A single-process engine does all of it in `launch` / `collect` or `execute`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from raylm.config import KernelConfig
from raylm.engine.messages import TokenLogprob
from raylm.engine.request import PLACEHOLDER
from raylm.engine.sampler import (
    PendingSamples,
    Sampler,
    SampleResult,
    merge_draws,
    put_rows,
    row_index,
    take_rows,
    to_device,
)
from raylm.engine.scheduler import SchedulerOutput
from raylm.engine.step_plan import StepPlan, plan_step
from raylm.engine.step_runner import ModelOutput
from raylm.kernels.attention import build_metadata
from raylm.kernels.fp8 import FP8_DTYPE, FP8_SCALE_DTYPE
from raylm.kernels.policy import KernelPolicy, choose_kernel_policy, set_kernel_policy
from raylm.kernels.triton_backend import TritonAttentionMetadata
from raylm.models.arch import ArchConfig

# Prompt log-probabilities are computed this many positions at a time, to bound the logits' memory.
_PROMPT_LOGPROB_ROWS = 256


def _guide_awaits_token(out: SchedulerOutput) -> bool:
    """Whether a sequence that draws in this step follows a grammar and its last token is still being drawn (a
    placeholder): its mask cannot be made before that token is in."""
    return any(item.completes and item.seq.guide is not None and item.seq.token_ids[-1] == PLACEHOLDER
               for item in out.scheduled)


@dataclass
class LaunchedStep:
    """A step queued on the device: its draws are on their way to the host."""

    out: SchedulerOutput
    positions: list[int]  # the scheduled items sampled, in the order of the sampler's rows
    samples: PendingSamples | None
    prompt_logprobs: dict[str, list[TokenLogprob]]
    # The logits of a step whose draws wait for the draws of the step before (a grammar's mask needs them):
    # ModelRunner.draw_waiting queues them later.
    waiting_logits: torch.Tensor | None = None

    def sample_slots(self) -> dict[int, int]:
        """id(sequence) -> the entry of its (single) draw in samples.tokens (sequences with drafts have none: the
        step after theirs waits for their results)."""
        if self.samples is None:
            return {}
        scheduled = self.out.scheduled
        entries = iter(self.samples.entries)
        slots = {}
        for position in self.positions:
            item = scheduled[position]
            row = next(entries)
            for _ in item.drafts:
                next(entries)
            if len(row) == 1 and not item.drafts:
                slots[id(item.seq)] = row[0]
        return slots


def logprob_entries(logprobs: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """(logprob, rank, top ids, top logprobs) of each row's target token."""
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        tops = zip(ids.tolist(), values.tolist())
    else:
        tops = ((None, None) for _ in chosen_list)
    return [(lp, rank, top_ids, top_lps) for lp, rank, (top_ids, top_lps) in zip(chosen_list, rank_list, tops)]


def resolve_attention_backend(requested: str, kernels: KernelPolicy) -> str:
    """The attention backend of a runner whose kernel policy is `kernels`, for attention_backend=requested: "auto"
    is Triton where the policy runs Triton kernels (a CUDA device, Triton, kernel_config.triton), else the torch
    reference; "triton" and "flashinfer" must be usable there."""
    if requested not in ("auto", "torch", "triton", "flashinfer"):
        raise ValueError(f"attention_backend must be one of 'auto', 'torch', 'triton', 'flashinfer'; got {requested!r}")
    on_triton = kernels.triton
    if requested == "auto":
        return "triton" if on_triton else "torch"
    if requested == "triton" and not on_triton:
        raise ValueError("attention_backend='triton' needs a CUDA device, Triton and kernel_config.triton")
    if requested == "flashinfer":
        from raylm.kernels.flashinfer_backend import flashinfer_available

        if not (on_triton and flashinfer_available()):
            raise ValueError("attention_backend='flashinfer' needs a CUDA device, Triton (it writes the KV cache; "
                             "kernel_config.triton) and the flashinfer package (pip install flashinfer-python)")
    return requested


def weight_bytes(model: nn.Module) -> int:
    """The bytes of this rank's weights, embeddings and LM head included."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def paged(layer: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """A layer's cache tensors that are paged by block: keys, values and per-row scales, not per-tensor scales."""
    return [tensor for tensor in layer if tensor.dim() > 1]


class ModelRunner:
    def __init__(self, model: nn.Module, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 block_size: int, seed: int = 0, attention_backend: str = "auto",
                 kernel_config: KernelConfig | None = None, capture_logits: bool = True,
                 fp8_kv_scales: str = "auto"):
        """`kernel_config` chooses the model's kernels (kernels/policy.py); `capture_logits`: decode graphs compute
        the logits and greedy draws too (cuda_graph_config.capture_logits); `fp8_kv_scales`: how an FP8 cache
        scales its rows (kv_cache_config.fp8_scales; "auto": per tensor where the checkpoint gave every layer here
        its KV scales, else per token)."""
        if fp8_kv_scales == "auto":
            scaled = all(getattr(layer.self_attn, "kv_tensor_scales", None) is not None for layer in model.local_layers)
            fp8_kv_scales = "per_tensor" if scaled and model.local_layers else "per_token"
        self.fp8_kv_scales = fp8_kv_scales
        self.model = model
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.sampler = Sampler(seed)
        # Per layer (k_cache, v_cache), and for an FP8 cache their scales after them (kernels/attention.py).
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.num_kv_heads = model.local_layers[0].self_attn.num_kv_heads
        self.num_local_layers = model.num_local_layers
        self.graphs = None
        self.prefill_graphs = None  # graphs of short prefills' rows (cuda_graph_config.prefill_max_tokens)
        self._side_stream = None  # _capture_stream's
        # The last decode graph replay's outputs (cuda_graphs.DecodeOutputs), for the compute_outputs and _draw
        # of the same step: its logits and greedy draws are already queued.
        self._graphed = None
        config = kernel_config or KernelConfig()
        self.kernels = choose_kernel_policy(device, weight_bytes(model), config.triton, config.decode_gemv,
                                            config.pdl, config.fp8_gemv_input, config.lora_expand,
                                            config.fp8_attention, config.gemv_tiles, config.gemv_prefetch)
        set_kernel_policy(model, self.kernels)
        self.capture_logits = capture_logits
        self.lora = None  # a LoraRuntime (models/lora.py) on engines serving LoRA adapters
        self.attention_backend = resolve_attention_backend(attention_backend, self.kernels)
        self.build_metadata = build_metadata
        if self.attention_backend == "triton":
            from raylm.kernels.triton_backend import build_triton_metadata

            self.build_metadata = build_triton_metadata
        elif self.attention_backend == "flashinfer":
            from raylm.kernels.flashinfer_backend import FlashInferPlanner

            attention = model.local_layers[0].self_attn
            self.build_metadata = FlashInferPlanner(attention.num_heads, attention.num_kv_heads, arch.head_dim,
                                                    attention.scale, dtype, device)

    # ------------------------------------------------------------------ KV cache

    def kv_bytes_per_block(self, kv_dtype: torch.dtype) -> int:
        """Bytes of one block of keys and values over this rank's layers; an FP8 cache's include their scales (a
        float32 per token and head) unless they are per tensor."""
        row_scales = kv_dtype == FP8_DTYPE and self.fp8_kv_scales == "per_token"
        element = kv_dtype.itemsize + (FP8_SCALE_DTYPE.itemsize / self.arch.head_dim if row_scales else 0)
        return int(2 * self.num_local_layers * self.block_size * self.num_kv_heads * self.arch.head_dim * element)

    @property
    def graph_logits(self) -> bool:
        """Whether decode graphs compute the logits and greedy draws (the last stage, unless capture_logits is off:
        eager launches after the graph then)."""
        return self.model.lm_head is not None and self.capture_logits

    def graphs_fit(self, pp_size: int) -> bool:
        """Whether capture_graphs captures decode graphs here (the kernels and the model allow them; with LoRA
        adapters, the Triton kernels of their products, which read each row's slot on the device)."""
        from raylm.engine.cuda_graphs import graph_ladder_fits

        if self.lora is not None and not self.kernels.triton:
            return False
        return self.attention_backend in ("triton", "flashinfer") and graph_ladder_fits(self.arch, pp_size)

    def graph_logits_bytes(self, max_batch: int, pp_size: int) -> int:
        """Device memory the decode graphs keep for logits (engine/cuda_graphs.py) when they compute them: the
        LM head's output and the buffer it is copied to (the model's dtype) and the greedy draws' float32 copy,
        for the largest graph."""
        if not (self.graph_logits and self.graphs_fit(pp_size)):
            return 0
        return max_batch * self.arch.vocab_size * (2 * self.dtype.itemsize + 4)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """num_blocks usable blocks plus the null block 0, which alone is zeroed: every other slot is
        written before attention reads it, so the rest is left uninitialised (and untouched on the CPU). An FP8
        cache on the Triton backend stores its values by slots (value_cache_by_slots), zeroed whole, and its scales
        by slots too (scales_by_slots: a tile's scales of one head in whole sectors); with per-tensor scales, each
        layer's two are one float32 each (the checkpoint's, else 1.0: Attention.kv_tensor_scales)."""
        if self.attention_backend == "flashinfer" and kv_dtype != self.dtype:
            raise ValueError(f"attention_backend='flashinfer' keeps the KV cache in the model's dtype ({self.dtype}), "
                             f"got kv_cache_config.dtype {kv_dtype}")
        fp8 = kv_dtype == FP8_DTYPE
        if fp8 and self.attention_backend not in ("torch", "triton"):
            raise ValueError(f"kv_cache_config.dtype='fp8' runs on the 'triton' and 'torch' attention backends, got "
                             f"attention_backend={self.attention_backend!r}")
        values_by_slots = fp8 and self.attention_backend == "triton"
        if values_by_slots:
            from raylm.kernels.triton_kv_cache import scales_by_slots, value_cache_by_slots
        shape = (num_blocks + 1, self.block_size, self.num_kv_heads, self.arch.head_dim)
        self.kv_caches = []
        for _ in range(self.num_local_layers):
            keys = torch.empty(shape, dtype=kv_dtype, device=self.device)
            if values_by_slots:
                values = value_cache_by_slots(shape, kv_dtype, self.device)
            else:
                values = torch.empty(shape, dtype=kv_dtype, device=self.device)
            layer = [keys, values]
            if fp8 and self.fp8_kv_scales == "per_tensor":
                layer += [torch.empty(1, dtype=FP8_SCALE_DTYPE, device=self.device) for _ in range(2)]
            elif values_by_slots:
                layer += [scales_by_slots(shape[:-1], self.device) for _ in range(2)]
            elif fp8:
                layer += [torch.empty(shape[:-1], dtype=FP8_SCALE_DTYPE, device=self.device) for _ in range(2)]
            self.kv_caches.append(tuple(layer))
        self.zero_null_block()
        self.fill_tensor_scales()

    def fill_tensor_scales(self) -> None:
        """Sets an FP8 cache's per-tensor scales to their layers' (the checkpoint's k_scale / v_scale, else 1.0)."""
        for layer, decoder_layer in zip(self.kv_caches, self.model.local_layers):
            if len(layer) > 2 and layer[2].dim() == 1:
                for tensor, scale in zip(layer[2:], decoder_layer.self_attn.kv_tensor_scales or (1.0, 1.0)):
                    tensor.fill_(scale)

    def zero_null_block(self) -> None:
        """Zeroes block 0 of every layer's cache (and scales), which padding rows and unused table entries read."""
        for layer in self.kv_caches:
            for tensor in paged(layer):
                tensor[0].zero_()

    def zero_unwritten_kv(self) -> None:
        """Zeroes what attention may read before it is written, in a cache whose pages came back with any contents
        (a resume at the same addresses): the null block, and all of a value cache stored by slots; sets per-tensor
        scales again."""
        self.zero_null_block()
        self.fill_tensor_scales()
        for layer in self.kv_caches:
            if layer[1].stride() != layer[0].stride():  # values by slots
                layer[1].zero_()

    def profile_activation_memory(self, num_tokens: int) -> int:
        """Peak device memory (bytes) a prefill step of num_tokens tokens takes beyond weights and KV cache,
        measured by running one with a temporary cache."""
        num_blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(num_blocks, self.dtype)
        blocks = list(range(1, num_blocks + 1))
        plan = StepPlan(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                        slot_mapping=[self.block_size + pos for pos in range(num_tokens)],
                        prefill_chunks=[(blocks, 0, num_tokens)], sample_rows=[num_tokens - 1])
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._run_alone(plan)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return max(0, peak)

    def _run_alone(self, plan: StepPlan) -> None:
        """This rank's stage of `plan` on its own (a later pipeline stage gets zero activations instead of the
        previous stage's), and its logits on the last stage: for start-up runs, not for steps."""
        intermediate = None
        if self.model.embed_tokens is None:
            hidden = torch.zeros(plan.num_tokens, self.arch.hidden_size, dtype=self.dtype, device=self.device)
            intermediate = (hidden, hidden.clone())
        result = self.forward(plan, intermediate)
        if self.model.lm_head is not None:
            self.compute_outputs(plan, result)

    @torch.inference_mode()
    def warm_up_decode(self, max_seq_len: int) -> None:
        """Runs eager decode steps that take each kernel variant a running engine can meet (single-pass and
        split-K attention), so that a later step never stops to compile; every read is of the null block
        and nothing is written (slot -1)."""
        if self.attention_backend == "torch":  # the torch path compiles nothing
            return
        for width in (1, -(-max_seq_len // self.block_size)):
            self._run_alone(StepPlan(input_ids=[0], positions=[0], slot_mapping=[-1],
                                     decode_contexts=[([0] * width, 1)], sample_rows=[0]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_graphs(self, batch_sizes: list[int], max_seq_len: int, pp_size: int, verify_rows: bool = False,
                       prefill_sizes: list[int] = ()) -> None:
        """Captures decode CUDA graphs (when the device, the kernels and the model allow them); with verify_rows
        (speculative decoding) graphs that also take a drafted sequence's positions as rows of their own. With
        prefill_sizes, on the Triton kernels, a second ladder for short prefills (their prompt tokens as rows of
        their own, no logits: a prompt needs only its last row's)."""
        from raylm.engine.cuda_graphs import DecodeGraphs

        if not self.graphs_fit(pp_size):
            return
        max_blocks = -(-max_seq_len // self.block_size)
        lora = self.lora.batch if self.lora is not None else None
        if prefill_sizes and self.attention_backend == "triton":
            prefill_graphs = DecodeGraphs(self.model, self.kv_caches, list(prefill_sizes), max_blocks,
                                          self.arch.hidden_size, self.dtype, self.device, self.arch.sliding_window,
                                          stream=self._capture_stream(), lora=lora, decode_write_first=True)
            prefill_graphs.capture()
            self.prefill_graphs = prefill_graphs
        flashinfer = None
        if self.attention_backend == "flashinfer":
            from raylm.kernels.flashinfer_backend import FlashInferDecodeGraphs

            flashinfer = FlashInferDecodeGraphs(self.build_metadata, batch_sizes, max_blocks, self.block_size,
                                                self.arch.sliding_window, self.device)
        graphs = DecodeGraphs(self.model, self.kv_caches, batch_sizes, max_blocks, self.arch.hidden_size,
                              self.dtype, self.device, self.arch.sliding_window, flashinfer, logits=self.graph_logits,
                              stream=self._capture_stream(), lora=lora, decode_write_first=verify_rows)
        graphs.capture()
        self.graphs = graphs

    def _capture_stream(self) -> torch.cuda.Stream:
        """The side stream every capture of this runner uses (DecodeGraphs' `stream`)."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)
        return self._side_stream

    def drop_graphs(self) -> None:
        """Frees the decode graphs (AsyncLLM.release): they read the weights and the KV cache at the addresses
        they had, so new ones are captured once those are back."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.free()
        self.graphs = self.prefill_graphs = None
        self._graphed = None  # views into the graphs' pool

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        sources = to_device([src for src, _ in copies], self.device)
        targets = to_device([dst for _, dst in copies], self.device)
        for layer in self.kv_caches:
            for tensor in paged(layer):
                tensor[targets] = tensor[sources]

    # ------------------------------------------------------------------ the parts of a step

    @torch.inference_mode()
    def forward(self, plan: StepPlan, intermediate=None, feed: tuple[torch.Tensor | int, torch.Tensor] | None = None):
        """This rank's share of the step: final hidden states on the last stage, (hidden, residual) before.
        feed = (rows: a sampler.row_index, token ids on the device) fills input rows whose token a step in flight
        is sampling."""
        self._copy_blocks(plan.block_copies)
        self._graphed = None
        graphs = self._step_graphs(plan) if intermediate is None else None
        if self.lora is not None:
            self.lora.prepare(plan.lora_loads, plan.lora_slots, graphs is not None and graphs.captured)
        if graphs is not None:
            self._graphed = graphs.run_step(plan.input_ids, plan.positions, plan.slot_mapping, plan.decode_contexts,
                                            feed, greedy=plan.greedy, lora_slots=plan.lora_slots)
            return self._graphed.hidden
        meta = self.build_metadata(
            decode_contexts=plan.decode_contexts,
            prefill_chunks=plan.prefill_chunks,
            slot_mapping=plan.slot_mapping,
            block_size=self.block_size,
            sliding_window=self.arch.sliding_window,
            device=self.device,
        )
        if plan.verify_rows and isinstance(meta, TritonAttentionMetadata):
            meta.decode_write_first = True
        input_ids = to_device(plan.input_ids, self.device)
        if feed is not None:
            put_rows(input_ids, *feed)
        return self.model(
            input_ids,
            to_device(plan.positions, self.device),
            self.kv_caches,
            meta,
            intermediate,
        )

    def _step_graphs(self, plan: StepPlan):
        """The graphs that replay this step: the decode graphs where they take its rows (verify rows only where
        they store keys first), else the prefill graphs; None where neither fits: the step runs eagerly."""
        if plan.prefill_chunks or not plan.decode_contexts:
            return None
        rows, width = len(plan.decode_contexts), max(len(blocks) for blocks, _ in plan.decode_contexts)
        for graphs in (self.graphs, self.prefill_graphs):
            if (graphs is not None and (not plan.verify_rows or graphs.takes_verify_rows)
                    and graphs.fits(rows, width)):
                return graphs
        return None

    @property
    def graph_prefill_rows(self) -> int:
        """The most rows of a step whose prompt tokens plan_step gives as rows of their own: the largest prefill
        graph's (0: prompts run eagerly, as prefill chunks)."""
        return self.prefill_graphs.max_batch if self.prefill_graphs is not None else 0

    @torch.inference_mode()
    def compute_outputs(self, plan: StepPlan, hidden: torch.Tensor
                        ) -> tuple[torch.Tensor | None, dict[str, list[TokenLogprob]]]:
        """On the last stage: the sampling logits [len(sample_rows), vocab] and the prompt log-probabilities.
        Every rank of a tensor-parallel stage calls this with the same plan (the logits are all-gathered)."""
        logits = None
        if plan.sample_rows:
            every_row = plan.sample_rows == list(range(hidden.shape[0]))
            graphed = self._graphed
            if graphed is not None and graphed.hidden is hidden and graphed.logits is not None and every_row:
                logits = graphed.logits  # the graph computed them
            else:
                logits = self.model.compute_logits(hidden if every_row else
                                                   hidden[to_device(plan.sample_rows, self.device)])
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        for spec in plan.prompt_logprobs:
            entries: list[TokenLogprob] = []
            for start in range(0, len(spec.rows), _PROMPT_LOGPROB_ROWS):
                rows = to_device(spec.rows[start : start + _PROMPT_LOGPROB_ROWS], self.device)
                targets = to_device(spec.targets[start : start + _PROMPT_LOGPROB_ROWS], self.device)
                logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
                entries.extend(logprob_entries(logprobs, targets, spec.num_top))
            prompt_logprobs[spec.request_id] = entries
        return logits, prompt_logprobs

    def sample(self, out: SchedulerOutput, logits: torch.Tensor | None) -> list[SampleResult | None]:
        """On rank 0: one SampleResult per scheduled sequence that completes this step."""
        positions, pending = self._draw(out, logits)
        return self._align(out, positions, pending)

    def _draw(self, out: SchedulerOutput, logits: torch.Tensor | None) -> tuple[list[int], PendingSamples | None]:
        scheduled = out.scheduled
        positions = [i for i, item in enumerate(scheduled) if item.completes]
        if not positions:
            return positions, None
        graphed = self._graphed
        greedy = graphed.greedy if graphed is not None and graphed.logits is logits else None
        rows = []
        for i in positions:
            item = scheduled[i]
            row = item.request.sampling_row(item.seq)
            if not item.drafts:
                rows.append(row)
            elif row.guide is None:  # a draw at each draft's position too, from the same row (its generator in order)
                rows.extend([row] * (1 + len(item.drafts)))
            else:  # the first row masks the drafts' rows too, each after its prefix of the drafts
                rows.append(dataclasses.replace(row, drafts=tuple(item.drafts)))
                rows.extend([dataclasses.replace(row, guide=None)] * len(item.drafts))
        return positions, self.sampler.sample(logits, rows, greedy)

    @staticmethod
    def _align(out: SchedulerOutput, positions: list[int], pending: PendingSamples | None
               ) -> list[SampleResult | None]:
        """One SampleResult per scheduled sequence that drew; a sequence with drafts gets one holding its draw at
        each of its positions, in order."""
        samples: list[SampleResult | None] = [None] * len(out.scheduled)
        if pending is not None:
            results = iter(pending.results())
            scheduled = out.scheduled
            for position in positions:
                result = next(results)
                drafts = scheduled[position].drafts
                if drafts:
                    result = merge_draws([result] + [next(results) for _ in drafts])
                samples[position] = result
        return samples

    can_overlap = True  # launch() queues a step without waiting for the device
    pipelined = False

    def feed_tokens(self, out: SchedulerOutput, plan: StepPlan, previous: LaunchedStep | None) -> torch.Tensor | None:
        """The tokens of plan.feed_rows (inputs that are placeholders): the entries of `previous` (the step in
        flight that samples them) on the device, nothing waited for."""
        if not plan.feed_rows:
            return None
        if previous is None or previous.samples is None:
            raise RuntimeError("a step's input token is a placeholder, but no step in flight samples it")
        slots = previous.sample_slots()
        sources = [slots[id(out.decodes[row].seq)] for row in plan.feed_rows]
        if previous.samples.precomputed:
            plan.feed_sources = sources
        return take_rows(previous.samples.tokens, row_index(sources, self.device))

    def graph_feed(self, plan: StepPlan) -> torch.Tensor:
        """On the other ranks of a tensor-parallel stage: the tokens of plan.feed_rows from the greedy draws of
        this rank's last decode graph (the step in flight), as rank 0's sampler took them from its own."""
        graphed = self._graphed
        if graphed is None or graphed.greedy is None:
            raise RuntimeError("the plan feeds greedy draws of a decode graph, but this rank's last step had none")
        return take_rows(graphed.greedy[0], row_index(plan.feed_sources, self.device))

    def launch_planned(self, out: SchedulerOutput, plan: StepPlan, fed: torch.Tensor | None) -> LaunchedStep:
        """Queues the forward, the logits and the draws of a planned step (`fed`: the tokens of its feed rows)."""
        feed = (row_index(plan.feed_rows, self.device), fed) if plan.feed_rows else None
        hidden = self.forward(plan, feed=feed)
        logits, prompt_logprobs = self.compute_outputs(plan, hidden)
        if logits is not None and _guide_awaits_token(out):
            return LaunchedStep(out, [], None, prompt_logprobs, waiting_logits=logits)
        positions, pending = self._draw(out, logits)
        return LaunchedStep(out, positions, pending, prompt_logprobs)

    def draw_waiting(self, launched: LaunchedStep) -> None:
        """Queues the draws of a launched step that waited for the tokens of the step before it: those are
        applied now (the engine applies a step before it launches the step after the next, or collects), so
        each guide has accepted its sequence's last token. The device is still on this step's forward
        meanwhile."""
        if launched.waiting_logits is not None:
            launched.positions, launched.samples = self._draw(launched.out, launched.waiting_logits)
            launched.waiting_logits = None

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queues a whole step (one rank holds the whole model) without waiting for the device. Input tokens
        that are placeholders come from `previous`, the step still in flight that samples them."""
        if previous is not None:
            self.draw_waiting(previous)  # before this step's forward overwrites the graphs' logits
        plan = plan_step(out, self.block_size, self.graph_prefill_rows)
        return self.launch_planned(out, plan, self.feed_tokens(out, plan, previous))

    def collect(self, launched: LaunchedStep) -> ModelOutput:
        """Waits for a launched step's draws."""
        self.draw_waiting(launched)
        return ModelOutput(self._align(launched.out, launched.positions, launched.samples), launched.prompt_logprobs)

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """A whole step in this process, waited for."""
        return self.collect(self.launch(out))
