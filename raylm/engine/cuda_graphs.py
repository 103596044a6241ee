"""CUDA graphs for decode steps: one graph per batch size of a ladder, replayed over static buffers.

A decode step of n sequences runs the graph of the smallest captured size >= n; the extra rows are
padding: their cache slot is -1 (nothing is written) and they attend to one key of the null block. Before
a replay the runner refills the static buffers in place (token ids, positions, slots, block tables,
context lengths); the graph then launches every kernel of the forward pass at once.

On the last stage a graph also computes its rows' logits (the LM head, and at TP > 1 their all-gather), and for
steps whose rows all draw greedily a second, small graph of each size the greedy token of each row with its
log-probability (sampler.greedy_draws): what the host otherwise launches after every step, one eager operation
at a time (at TP=2 on the H200 that host work, not the GPU, bounded a batch-1 step). Other steps sample from the
logits, and pay nothing for the greedy graph.

Short prefills (cuda_graph_config.prefill_max_tokens) replay a second ladder of the same graphs, captured to store
every row's key and value before any row attends: a prompt's tokens are then rows of their own, each attending to
its prefix as a decode row does (step_plan.plan_step's graph_rows). Eager, a short prefill is bound by the host's
launches (each of an 8B model's layers takes several eager operations a linear layer); a replay is one launch.
Those graphs leave the logits to the step (only the prompts' last rows need them).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

from raylm.engine.sampler import greedy_draws, put_rows
from raylm.kernels.triton_backend import TritonAttentionMetadata

logger = logging.getLogger(__name__)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 64 beyond, and max_batch_size itself."""
    sizes = [1, 2, 4, 8]
    step_sizes = [(64, 8), (256, 16), (max_batch_size, 64)]
    size = 8
    for limit, step in step_sizes:
        while size + step <= min(limit, max_batch_size):
            size += step
            sizes.append(size)
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


def prefill_row_sizes(max_rows: int) -> list[int]:
    """The prefill graphs' sizes: 16, 32, 64, ... up to max_rows, and max_rows itself (none for 0)."""
    sizes = []
    size = 16
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return sizes + [max_rows] if max_rows > 0 else []


class BlockTableStaging:
    """A host block table whose rows are kept from step to step: a row is written again only where its
    sequence's block list changed. Block lists are only ever appended to (any other change makes a new list:
    Sequence.block_ids), so a row is current while it holds the same list object at the same length, and a
    longer one needs only its new tail. Columns past a row's length may hold stale blocks: the kernels read a
    row only up to its context length."""

    def __init__(self, table: np.ndarray):
        self.table = table
        self.rows: list[tuple[list[int], int] | None] = [None] * table.shape[0]

    def fill(self, contexts: list[tuple[list[int], int]], batch: int) -> int:
        """Rows for the (block list, context length) of each sequence, then padding rows up to `batch` that
        read the null block; returns the width in use (the longest block list)."""
        table, rows = self.table, self.rows
        width = 0
        for row, (blocks, _) in enumerate(contexts):
            length = len(blocks)
            held = rows[row]
            if held is None or held[0] is not blocks or length < held[1]:
                # a prompt's rows share one list: the row before is already current (a row copy, no list read)
                table[row, :length] = table[row - 1, :length] if row and contexts[row - 1][0] is blocks else blocks
                rows[row] = (blocks, length)
            elif length > held[1]:
                table[row, held[1] : length] = blocks[held[1] :]
                rows[row] = (blocks, length)
            if length > width:
                width = length
        for row in range(len(contexts), batch):
            table[row, 0] = 0  # padding rows read the null block
            rows[row] = None
        return width


@dataclass
class DecodeOutputs:
    """One replayed decode step, for its n rows (views of the graphs' outputs, valid until the next replay is
    queued): final hidden states [n, hidden]; on the last stage the logits [n, vocab], and when the step asked
    for them their greedy_draws (tokens [n], log-probabilities [n]); None otherwise."""

    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    greedy: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, count: int) -> DecodeOutputs:
        greedy = None if self.greedy is None else (self.greedy[0][:count], self.greedy[1][:count])
        return DecodeOutputs(self.hidden[:count], None if self.logits is None else self.logits[:count], greedy)


class DecodeGraphs:
    def __init__(self, model, kv_caches, batch_sizes: list[int], max_blocks: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, sliding_window: int | None, flashinfer=None,
                 logits: bool = False, stream: torch.cuda.Stream | None = None, lora=None,
                 decode_write_first: bool = False):
        """stream: the side stream to capture on; one kept by the caller for every capture, since cuBLAS keeps a
        workspace per stream for good (a new stream per capture grew the process by 32 MB a capture on the H200).
        flashinfer: the FlashInfer backend's FlashInferDecodeGraphs, whose wrappers the graphs then attend
        through (planned before each replay); None for the Triton kernels (block tables and context lengths
        in static buffers). logits: whether the graphs compute the logits too, with a greedy-draw graph of
        each size beside them (the model's last stage). lora: the model's LoraBatch (models/lora.py) when it serves
        LoRA adapters: each replay then reads its rows' slots from a buffer of the graphs (-1: the base model), and
        the adapted layers launch the same kernels whatever the rows' adapters; a second set of graphs, without
        those kernels, serves the steps whose rows have no adapter (256 launches fewer on an 8B model).
        decode_write_first: the Triton kernels store every row's key and value before any row attends, so that a
        replay may hold several positions of one sequence (speculative decoding's verify rows); FlashInfer's graphs
        always do."""
        self.model = model
        self.with_logits = logits
        self.stream = stream
        # The logits of every graph, in one buffer of the largest batch (allocated at the first forward): the
        # graphs' own would each hold theirs for good (~0.6 GB over the default ladder of a 128k vocabulary).
        self.logits_buffer: torch.Tensor | None = None
        self.flashinfer = flashinfer
        self.kv_caches = kv_caches
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = max_blocks
        self.device = device
        self.sliding_window = sliding_window
        size = self.max_batch
        # Token ids, positions, cache slots and context lengths: the rows of one buffer, refilled by one copy.
        self.vectors = torch.zeros(4, size, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self.vectors
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.lora = lora
        self.decode_write_first = decode_write_first
        self.takes_verify_rows = decode_write_first or flashinfer is not None
        self.lora_slots = torch.full((size,), -1, dtype=torch.int32, device=device) if lora is not None else None
        # Host staging, pinned on CUDA so the copies are asynchronous. Two sets, used in turn: a step's copies
        # may still be queued when the next step is prepared (overlapped scheduling), never two steps later.
        pin = device.type == "cuda"
        self.staging = [(torch.zeros(4, size, dtype=torch.long, pin_memory=pin),
                         torch.zeros(size, max_blocks, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self.lora_staging = ([torch.full((size,), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
                             if lora is not None else [])
        self.tables = [BlockTableStaging(table.numpy()) for _, table in self.staging]
        self.turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, DecodeOutputs] = {}
        # A model with LoRA adapters: the graphs (and their outputs) of steps without adapters.
        self.base_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.base_outputs: dict[int, DecodeOutputs] = {}
        self.greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.greedy_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hidden_size = hidden_size
        self.dtype = dtype

    def _metadata(self, batch: int):
        if self.flashinfer is not None:
            return self.flashinfer.metadata(batch, self.slot_mapping[:batch])
        return TritonAttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], num_decodes=batch,
            decode_block_tables=self.block_tables[:batch], decode_context_lens=self.context_lens[:batch],
            sliding_window=self.sliding_window, decode_write_first=self.decode_write_first,
        )

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _forward(self, batch: int, adapters: bool = True) -> DecodeOutputs:
        """The forward the graphs capture; adapters: with the LoRA kernels (a model with adapters)."""
        if self.lora is not None:
            self.lora.in_graph = True
            self.lora.graph_slots = self.lora_slots if adapters else None
        try:
            hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches,
                                self._metadata(batch))
        finally:
            if self.lora is not None:
                self.lora.in_graph = False
                self.lora.graph_slots = None
        if not self.with_logits:
            return DecodeOutputs(hidden)
        logits = self.model.compute_logits(hidden)
        if self.logits_buffer is None:
            self.logits_buffer = torch.empty(self.max_batch, logits.shape[-1], dtype=logits.dtype,
                                             device=logits.device)
        buffered = self.logits_buffer[:batch]
        buffered.copy_(logits)
        return DecodeOutputs(hidden, buffered)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = self.stream or torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for batch in reversed(self.batch_sizes):  # the largest first, so the others reuse its memory
                if self.flashinfer is not None:
                    self.flashinfer.plan(batch, [])  # padding rows only: the buffers hold the null block
                sets = [(self.graphs, self.outputs, True)]
                if self.lora is not None:
                    sets.append((self.base_graphs, self.base_outputs, False))
                for graphs, outputs, adapters in sets:
                    for _ in range(2):  # warm-up: compile and tune kernels outside the capture
                        self._forward(batch, adapters)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        outputs[batch] = self._forward(batch, adapters)
                    graphs[batch] = graph
                if self.with_logits:
                    logits = self.outputs[batch].logits
                    greedy_draws(logits)  # warm-up
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.greedy_outputs[batch] = greedy_draws(logits)
                    self.greedy_graphs[batch] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def free(self) -> None:
        """Lets go of the graphs and all they hold (their memory pool, its outputs, the logits buffer, the KV cache
        list), so that the memory goes back even while something still refers to this object."""
        for graph in (*self.graphs.values(), *self.base_graphs.values(), *self.greedy_graphs.values()):
            graph.reset()
        self.graphs.clear()
        self.base_graphs.clear()
        self.greedy_graphs.clear()
        self.outputs.clear()
        self.base_outputs.clear()
        self.greedy_outputs.clear()
        self.logits_buffer = None
        self.kv_caches = []

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return 0 < num_seqs <= self.max_batch and max_blocks <= self.max_blocks

    @torch.inference_mode()
    def run_step(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
                 contexts: list[tuple[list[int], int]], feed: tuple[torch.Tensor | int, torch.Tensor] | None = None,
                 greedy: bool = False, lora_slots: list[int] | None = None) -> DecodeOutputs:
        """Replays the graph for these decodes (and with `greedy`, on the last stage, the graph of their greedy
        draws); returns its outputs for their rows. feed = (rows: a sampler.row_index, token ids on the device)
        overwrites input rows whose token an earlier step, still in flight, samples. lora_slots: each row's adapter
        slot (-1: none; empty or None: no row has one), for graphs of a model with LoRA adapters."""
        count = len(input_ids)
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, count)]
        host_vectors, host_table = self.staging[self.turn]
        table_staging = self.tables[self.turn]
        adapters = self.lora is not None and bool(lora_slots) and max(lora_slots) >= 0
        if adapters:
            host_slots = self.lora_staging[self.turn]
            slots = host_slots.numpy()
            slots[:count] = lora_slots
            slots[count:batch] = -1
            self.lora_slots[:batch].copy_(host_slots[:batch], non_blocking=True)
        self.turn = 1 - self.turn
        vectors = host_vectors.numpy()
        vectors[0, :count] = input_ids
        vectors[0, count:batch] = 0  # padding rows: any valid id (stale rows may hold placeholders)
        vectors[1, :count] = positions
        vectors[2, :count] = slot_mapping
        vectors[2, count:batch] = -1
        vectors[3, :count] = [length for _, length in contexts]
        vectors[3, count:batch] = 1
        self.vectors.copy_(host_vectors, non_blocking=True)  # whole rows: one contiguous copy of 32 B per slot
        if self.flashinfer is None:  # the Triton kernels read block tables; FlashInfer its planned pages
            width = table_staging.fill(contexts, batch)
            self.block_tables[:batch, :width].copy_(host_table[:batch, :width], non_blocking=True)
        else:
            self.flashinfer.plan(batch, contexts)
        if feed is not None:
            put_rows(self.input_ids, *feed)
        graphs, outputs = ((self.graphs, self.outputs) if adapters or self.lora is None
                           else (self.base_graphs, self.base_outputs))
        if batch in graphs:
            graphs[batch].replay()
            outputs = outputs[batch]
            if greedy and batch in self.greedy_graphs:
                self.greedy_graphs[batch].replay()
                outputs = DecodeOutputs(outputs.hidden, outputs.logits, self.greedy_outputs[batch])
        else:  # not captured (tests on the CPU): the same buffers, run eagerly
            outputs = self._forward(batch, adapters)
            if greedy and outputs.logits is not None:
                outputs.greedy = greedy_draws(outputs.logits)
        return outputs.rows(count)


def graph_ladder_fits(arch, pp_size: int) -> bool:
    """Graphs need a forward without host synchronisation: not the mixture-of-experts block (it routes on
    the host) and not pipeline stages (they exchange activations between processes)."""
    return arch.num_experts == 0 and pp_size == 1

