"""LoRA on a worker: adapter slots in the model's linear layers, and loading adapters into them.

Every adapted layer holds max_loras slots in two stacked tensors allocated once, lora_a [slots, slices * max_rank,
in] and lora_b [slots, out, max_rank] (ranks padded with zeros), so that the kernels (and later CUDA graphs) read
them in place. A fused layer holds one adapter per projection it fuses (q / k / v, gate / up): their A matrices
side by side in lora_a, their B matrices at their projection's output rows in lora_b.

Tensor parallelism shards adapters as it shards their layers, through the layers' own weight loaders: a
column-parallel layer (qkv, gate_up) keeps A whole and this rank's rows of B; a row-parallel layer (o, down) keeps
this rank's input columns of A and B whole, and its product joins the partial sums the layer all-reduces.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raylm.config import LoraConfig
from raylm.kernels.linear import linear
from raylm.kernels.lora import SlotRows, add_lora, add_lora_by_rows
from raylm.kernels.policy import KernelPolicy
from raylm.lora_request import LoRARequest
from raylm.models.arch import ArchConfig
from raylm.models.lora_adapter import ModuleKey, adapter_matrices, check_adapter_in_memory, read_adapter

# A PEFT projection -> (the fused layer holding it inside a decoder layer, its shard id there). The shard ids are
# those the layers' weight loaders take (LlamaForCausalLM.stacked_params); None: the layer is that projection alone.
FUSED_TARGETS: dict[str, tuple[str, object]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", None),
}


# Steps of at most this many rows run the adapters' products in the Triton kernels where the kernel policy runs
# Triton (one program per row: decode-sized steps); larger ones there in the segment kernels (runs of rows of one
# slot in blocks, on the tensor cores), and elsewhere group rows by slot in torch, one matmul a slot.
TRITON_MAX_ROWS = 64
# Elsewhere, steps of at most BY_ROWS_MAX_ROWS rows with adapters, at most BY_ROWS_PER_ADAPTER of them an adapter on
# average, gather each row's adapter (add_lora_by_rows: two batched matmuls); others group rows by slot (add_lora:
# two matmuls a slot). The crossover on SmolLM2's shapes on the CPU (docs/benchmarks.md): 8 rows of 8 adapters
# 0.3 against 0.9 ms a layer, level at 8 rows an adapter, and gathering many rows outgrows the caches.
BY_ROWS_MAX_ROWS = 64
BY_ROWS_PER_ADAPTER = 4


class SideStream:
    """A second CUDA stream for work that needs only a layer's input (kernel_config.lora_expand 'beside'): fork()
    has it wait for what the current stream has queued so far and makes it current (a context); join() has the
    current stream wait for what it queued. Captured in a decode graph, the work between becomes a branch of the
    graph that runs beside the current stream's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def fork(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


@dataclass
class PendingProducts:
    """A row-parallel layer's output (o, down; one rank) with its LoRA products (float32) not yet added: the RMSNorm
    after it adds them in its own kernel (kernels/norm.py) rather than an add of their own; anything else calls
    materialize(). The sum rounds as out.add_(products) does."""

    out: torch.Tensor
    products: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return self.out.add_(self.products)


class LoraBatch:
    """The rows of the current step that use each adapter slot, shared by every adapted layer of a model."""

    def __init__(self) -> None:
        self.side: SideStream | None = None  # on CUDA (LoraRuntime), for kernel_config.lora_expand 'beside'
        self.has_adapters = False  # some row of the step (outside a decode graph) uses an adapter
        # The step's rows' slots on the host, and their device: the torch paths' groups and by_rows, built from them
        # on first use (a step the Triton kernels take never builds them, nor copies their indices to the device).
        self._host_slots = np.zeros(0, dtype=np.int64)
        self._device = torch.device("cpu")
        # Each row's slot on the device, for the Triton kernels (a CUDA step of at most TRITON_MAX_ROWS rows).
        self.row_slots: torch.Tensor | None = None
        # A larger CUDA step's runs of rows of one slot in blocks, on the device (kernels/triton_lora.py's
        # segment_blocks), and the step's rows: the segment kernels' launches.
        self.segments: torch.Tensor | None = None
        self.segment_rows = 0
        # While a decode graph runs its forward (engine/cuda_graphs.py), captured or not: in_graph, and graph_slots,
        # the graph's own buffer of its rows' slots, which each replay refills (the layers then launch the Triton
        # kernels whatever the rows' adapters), or None in the graphs of steps whose rows have no adapter.
        self.in_graph = False
        self.graph_slots: torch.Tensor | None = None

    def set_rows(self, row_slots: list[int], device: torch.device, graphed: bool = False) -> None:
        """row_slots: each row's slot, -1 for the base model (empty: no row has an adapter). graphed: the step
        replays a captured decode graph, which reads the slots from its own buffer."""
        self.row_slots = None
        self.segments = None
        self.has_adapters = False
        self._host_slots = np.zeros(0, dtype=np.int64)
        self.__dict__.pop("groups", None)  # the last step's, cached by the properties below
        self.__dict__.pop("by_rows", None)
        if graphed:
            return
        slots = np.asarray(row_slots, dtype=np.int64)
        self.has_adapters = bool((slots >= 0).any())
        # Host-to-device copies without a stream sync: the step's launches queue behind the previous step's.
        if device.type == "cuda" and 0 < len(row_slots) <= TRITON_MAX_ROWS:
            self.row_slots = torch.from_numpy(slots.astype(np.int32)).to(device, non_blocking=True)
        elif device.type == "cuda" and self.has_adapters:
            from raylm.kernels.triton_lora import segment_blocks

            self.segments = torch.from_numpy(segment_blocks(slots)).to(device, non_blocking=True)
            self.segment_rows = len(slots)
        if self.has_adapters:
            self._host_slots, self._device = slots, device

    @functools.cached_property
    def groups(self) -> list[SlotRows]:
        """The rows of each slot the step uses (add_lora), built on first use."""
        slots = self._host_slots
        groups = []
        for slot in np.unique(slots[slots >= 0]).tolist():
            rows = np.flatnonzero(slots == slot)
            groups.append((slot, None if len(rows) == len(slots) else self._to_device(rows)))
        return groups

    @functools.cached_property
    def by_rows(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """Where the step gathers each row's adapter (add_lora_by_rows): the rows with one (None: every row) and
        their slots; else None. Built on first use."""
        slots = self._host_slots
        with_adapter = np.flatnonzero(slots >= 0)
        adapters = len(np.unique(slots[with_adapter]))
        if (self.row_slots is not None or adapters < 2 or len(with_adapter) > BY_ROWS_MAX_ROWS
                or len(with_adapter) > BY_ROWS_PER_ADAPTER * adapters):
            return None
        rows = None if len(with_adapter) == len(slots) else self._to_device(with_adapter)
        return rows, self._to_device(slots[with_adapter])

    def _to_device(self, indices: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(indices).to(self._device, non_blocking=True)


class LayerAdapters(nn.Module):
    """One linear layer's adapter slots (see the module's docstring); called with the layer's output and input, it
    adds each row's adapter product."""

    def __init__(self, layer: nn.Module, shard_ids: list[object], slice_sizes: list[int], row_parallel: bool,
                 batch: LoraBatch, max_loras: int, max_rank: int, dtype: torch.dtype):
        super().__init__()
        out_features, in_features = layer.weight.shape
        device = layer.weight.device
        self.shard_ids = shard_ids
        self.slice_sizes = slice_sizes
        self.row_parallel = row_parallel
        self.max_rank = max_rank
        self.batch = batch
        self.kernels = KernelPolicy()  # the model's, once the runner sets it (kernels/policy.py)
        self._load_shard = layer._load  # the layer's own loader shards adapters as it shards weights
        self.register_buffer("lora_a", torch.zeros(max_loras, len(slice_sizes) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, out_features, max_rank, dtype=dtype, device=device),
                             persistent=False)

    def adds(self) -> bool:
        """Whether the step adds any adapter's product here: in a decode graph, one with the LoRA kernels; else a
        step with a row of an adapter."""
        return self.batch.graph_slots is not None if self.batch.in_graph else self.batch.has_adapters

    def triton_slots(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's slot where the Triton kernels take this step's rows (a decode graph with adapters: the same
        launches each replay, each row's slot read from the graph's buffer; an eager CUDA step of at most
        TRITON_MAX_ROWS rows with adapters); None: nothing to add, or added in torch (forward)."""
        if not isinstance(x, torch.Tensor) or not self.kernels.on_triton(x):
            return None
        batch = self.batch
        if batch.in_graph:
            slots = batch.graph_slots[: x.shape[0]] if batch.graph_slots is not None else None
        else:
            slots = batch.row_slots if batch.has_adapters else None
        return slots if slots is not None and slots.shape[0] == x.shape[0] else None

    def shrink(self, x: torch.Tensor):
        """Where the Triton kernels take this step's rows (triton_slots): launches the shrink and returns its
        LoraRows, for the expand after the GEMV that computes the layer's output (kernels/linear.py); else None."""
        slots = self.triton_slots(x)
        if slots is None:
            return None
        from raylm.kernels.triton_lora import lora_shrink

        return lora_shrink(x, self.lora_a, self.lora_b, self.slice_sizes, slots, self.kernels.pdl)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               weight_scale: torch.Tensor | None, defer_add: bool = False) -> torch.Tensor | PendingProducts:
        """The adapted layer's x W^T + b with each row's adapter product. defer_add: the products computed beside
        the GEMV may come back unadded (PendingProducts), for the RMSNorm after the layer to add."""
        if self.kernels.lora_beside and self.batch.side is not None:
            slots = self.triton_slots(x)
            if slots is not None:
                pending = self._linear_beside(x, weight, bias, weight_scale, slots)
                return pending if defer_add else pending.materialize()
        lora = self.shrink(x)
        out = linear(x, weight, bias, self.kernels, weight_scale, lora=lora)
        return out if lora is not None else self(out, x)

    def _linear_beside(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       weight_scale: torch.Tensor | None, slots: torch.Tensor) -> PendingProducts:
        """kernel_config.lora_expand 'beside': the shrink and the products (float32) on the side stream while the
        GEMV runs, joined before they are added to its output. The products' buffer is made on the current stream
        before the fork, so it is freed there, after the join."""
        from raylm.kernels.triton_lora import lora_products, lora_shrink

        side = self.batch.side
        products = torch.empty(x.shape[0], self.lora_b.shape[1], dtype=torch.float32, device=x.device)
        with side.fork():  # plain launches: the branch's first kernel follows another stream's
            lora_products(lora_shrink(x, self.lora_a, self.lora_b, self.slice_sizes, slots), out=products)
        out = linear(x, weight, bias, self.kernels, weight_scale)
        side.join()
        return PendingProducts(out, products)

    def forward(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out plus each row's adapter product where shrink gave nothing: in the segment kernels (a larger CUDA
        step), else in torch (rows grouped by slot, or each row's adapter gathered: LoraBatch.by_rows)."""
        if self.batch.in_graph and self.batch.graph_slots is None:  # the graphs of steps without adapters
            return out
        # (graphs run uncaptured on the CPU take the rows' groups, as an eager step does)
        if not self.batch.has_adapters:
            return out
        if self._on_segments(x):
            from raylm.kernels.triton_lora import add_lora_segments

            return add_lora_segments(out, x, self.lora_a, self.lora_b, self.slice_sizes, self.batch.segments)
        if self.batch.by_rows is not None:
            rows, slots = self.batch.by_rows
            return add_lora_by_rows(out, x, self.lora_a, self.lora_b, self.slice_sizes, rows, slots)
        return add_lora(out, x, self.lora_a, self.lora_b, self.slice_sizes, self.batch.groups)

    def _on_segments(self, x: torch.Tensor) -> bool:
        """Whether this step's products here go through the segment kernels: a CUDA step of more rows than
        decode's, with the Triton kernels on, and the layer's ranks within their tile."""
        if self.batch.segments is None or x.shape[0] != self.batch.segment_rows:
            return False
        from raylm.kernels.triton_lora import SEGMENT_MAX_RANKS

        return self.lora_a.shape[1] <= SEGMENT_MAX_RANKS and self.kernels.on_triton(x)

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def load(self, slot: int, shard_id: object, a: torch.Tensor, b: torch.Tensor) -> None:
        """Puts this rank's share of one projection's full A [r, in] and B [out, r] into `slot`."""
        rank = a.shape[0]
        if self.row_parallel:
            self._load_shard(self.lora_a[slot, :rank], a)
            self.lora_b[slot, :, :rank].copy_(b)
            return
        start = self.shard_ids.index(shard_id) * self.max_rank
        self.lora_a[slot, start : start + rank].copy_(a)
        self._load_shard(self.lora_b[slot, :, :rank], b, shard_id)


def _slices(layer: nn.Module, path: str) -> tuple[list[object], list[int]]:
    """The shard ids a fused layer takes, in the order of its output rows, and each one's rows on this rank."""
    if path.endswith("qkv_proj"):
        return ["q", "k", "v"], [layer.q_size, layer.kv_size, layer.kv_size]
    if path.endswith("gate_up_proj"):
        return [0, 1], list(layer.shard_sizes)
    return [None], [layer.weight.shape[0]]


class LoraRuntime:
    """A worker's LoRA state: the slots of every adapted layer of its stage, the adapters read from disk (the
    max_cpu_loras least recently used), those added (add_lora: kept until removed), and the rows of the step
    (prepare, before each forward)."""

    def __init__(self, model: nn.Module, arch: ArchConfig, config: LoraConfig, dtype: torch.dtype,
                 device: torch.device):
        self.arch = arch
        self.config = config
        self.dtype = dtype
        self.device = device
        self.batch = LoraBatch()
        if device.type == "cuda":
            self.batch.side = SideStream(device)
        self.targets: dict[ModuleKey, tuple[LayerAdapters, object]] = {}
        self.layers: list[LayerAdapters] = []
        for index in range(model.start_layer, model.end_layer):
            decoder_layer = model.layers[index]
            for path in dict.fromkeys(target for target, _ in FUSED_TARGETS.values()):
                if path.startswith("mlp.") and arch.is_moe_layer(index):
                    continue
                layer = decoder_layer.get_submodule(path)
                shard_ids, sizes = _slices(layer, path)
                adapters = LayerAdapters(layer, shard_ids, sizes, path.endswith(("o_proj", "down_proj")), self.batch,
                                         config.max_loras, config.max_lora_rank, dtype)
                layer.lora = adapters
                self.layers.append(adapters)
                for module, (target, shard_id) in FUSED_TARGETS.items():
                    if target == path:
                        self.targets[(index, module)] = (adapters, shard_id)
        self._read: OrderedDict[int, dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self._added: dict[int, dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]] = {}

    def prepare(self, loads: list[tuple[int, LoRARequest]], row_slots: list[int], graphed: bool = False) -> None:
        """Before a step's forward: loads the adapters the engine placed in slots for it, and takes its rows'
        slots (-1: the base model; graphed: the step replays a captured graph, which takes them itself)."""
        for slot, request in loads:
            self.load(slot, request)
        self.batch.set_rows(row_slots, self.device, graphed)

    def load(self, slot: int, request: LoRARequest) -> None:
        """Fills `slot` with the adapter: this stage's layers it adapts, zeros elsewhere."""
        matrices = self._matrices(request)
        for adapters in self.layers:
            adapters.clear(slot)
        for key, (a, b) in matrices.items():
            target = self.targets.get(key)
            if target is not None:  # None: a layer of another pipeline stage
                adapters, shard_id = target
                adapters.load(slot, shard_id, a, b)

    def add(self, request: LoRARequest) -> None:
        """Keeps the adapter's matrices (read from its path, or taken from memory) until remove: adapters added so
        are not subject to the cache of those read (an RL trainer's in-memory adapter has nowhere to be read
        again from)."""
        if request.in_memory:
            spec = check_adapter_in_memory(request.lora_name, request.peft_config, request.lora_tensors, self.arch,
                                           self.config.max_lora_rank)
            matrices = adapter_matrices(spec, request.lora_tensors, self.dtype)
        else:
            _, matrices = read_adapter(request.lora_path, self.arch, self.config.max_lora_rank, self.dtype)
        self._read.pop(request.lora_int_id, None)
        self._added[request.lora_int_id] = matrices

    def remove(self, lora_int_id: int) -> bool:
        """Forgets the adapter's matrices (added or read); whether there were any."""
        added = self._added.pop(lora_int_id, None)
        read = self._read.pop(lora_int_id, None)
        return added is not None or read is not None

    def added(self) -> list[int]:
        return sorted(self._added)

    def _matrices(self, request: LoRARequest) -> dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's matrices: those added, else from the cache of those read, else from disk."""
        added = self._added.get(request.lora_int_id)
        if added is not None:
            return added
        cached = self._read.get(request.lora_int_id)
        if cached is not None:
            self._read.move_to_end(request.lora_int_id)
            return cached
        if not request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_int_id} ({request.lora_name!r}) is not loaded on this "
                             "worker: add it first (add_lora)")
        _, matrices = read_adapter(request.lora_path, self.arch, self.config.max_lora_rank, self.dtype)
        self._read[request.lora_int_id] = matrices
        while len(self._read) > self.config.cpu_cache_size:
            self._read.popitem(last=False)
        return matrices
