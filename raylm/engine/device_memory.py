"""What a rank holds on its device, by tag, and the release and resume of each tag (AsyncLLM.release / resume):

- `model_weights`: the model's parameters; a host copy (pinned on GPUs) is kept unless sleep_config says
  `discard`, when update_weights refills them after resume;
- `kv_cache`: the paged KV cache, always discarded (the engine preempts parked requests and forgets its cached
  prefixes first: EngineCore.forget_kv);
- `cuda_graph`: the decode CUDA graphs, captured again on resume;
- `model`: the rest the model keeps on the device (its buffers, such as the rotary tables), copied to the host.

Two ways to give memory back (sleep_config.keep_addresses):
- reallocate: released tensors are freed (on GPUs the allocator's cache is emptied too, so the memory goes back to
  the device) and resumed ones allocated anew. New addresses invalidate captured graphs, so releasing the weights
  or the cache drops the graphs as well, and they are captured again once weights, cache and graphs are resident.
- keep addresses (CUDA, torch-memory-saver): the weights, the buffers and the KV cache are allocated in regions
  whose physical pages are unmapped on release and mapped again on resume at the same virtual addresses, so the
  decode graphs stay valid and resume captures nothing. The graphs' own memory is still dropped and captured again
  when `cuda_graph` is released.
Release and resume are idempotent.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch

TAGS = ("model_weights", "kv_cache", "cuda_graph", "model")
WEIGHT_RESTORE_MODES = ("host_copy", "discard")


def check_tags(tags: list[str]) -> list[str]:
    """`tags` as given, once each, after checking every one is a memory tag."""
    if isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags):
        raise TypeError(f"tags must be a list of tag names, got {tags!r}")
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; tags are {list(TAGS)}")
    return list(dict.fromkeys(tags))


FIXED_TAGS = ("model_weights", "kv_cache", "model")  # the tags whose tensors keep their addresses
_fixed_addresses = None  # one per process: the memory saver's allocator hooks are process-wide


class FixedAddresses:
    """Tagged device memory whose physical pages go back to the device and return at the same virtual addresses
    (CUDA virtual memory through torch-memory-saver, with its in-process pluggable allocator)."""

    def __init__(self):
        import torch_memory_saver

        self.saver = torch_memory_saver.TorchMemorySaver()
        self.saver.hook_mode = "torch"  # no LD_PRELOAD: a Ray worker's environment is set before it starts

    def region(self, tag: str, keep_contents: bool = False):
        """Tensors allocated inside belong to `tag`; with keep_contents a pinned host copy refills them on resume."""
        return self.saver.region(tag=tag, enable_cpu_backup=keep_contents)

    def pause(self, tag: str) -> None:
        self.saver.pause(tag)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)


def fixed_addresses(keep_addresses: bool | None, device: torch.device) -> FixedAddresses | None:
    """The process's FixedAddresses when sleep_config.keep_addresses asks for them (None: where torch-memory-saver
    is installed and the device is CUDA), else None; a clear error when asked for where they cannot be had."""
    global _fixed_addresses
    if keep_addresses is False or (device.type != "cuda" and keep_addresses is None):
        return None
    if device.type != "cuda":
        raise ValueError(f"sleep_config.keep_addresses=true needs a CUDA device, got {device}")
    if _fixed_addresses is None:
        try:
            _fixed_addresses = FixedAddresses()
        except ImportError as error:
            if keep_addresses:
                raise ValueError("sleep_config.keep_addresses=true needs the torch-memory-saver package: "
                                 "pip install torch-memory-saver") from error
            return None
    return _fixed_addresses


@contextlib.contextmanager
def region(fixed: FixedAddresses | None, tag: str, keep_contents: bool = False) -> Iterator[None]:
    """FixedAddresses.region, or nothing when addresses are not kept."""
    if fixed is None:
        yield
    else:
        with fixed.region(tag, keep_contents):
            yield


def move_into_region(fixed: FixedAddresses | None, tensors: list[torch.Tensor], tag: str,
                     keep_contents: bool) -> None:
    """Copies `tensors` into `tag`'s region in place of their old storage (the model's buffers, made while loading
    inside the weights' region, go to the `model` tag's)."""
    if fixed is None:
        return
    with fixed.region(tag, keep_contents):
        for tensor in tensors:
            tensor.data = tensor.data.clone()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class TaggedMemory:
    """One rank's device memory by tag. `capture_graphs` captures the runner's decode graphs (a no-op where a rank
    has none); `weight_restore` is sleep_config.model_weights; `fixed`: the FixedAddresses the weights, buffers and
    KV cache were allocated in (their regions made with the same weight_restore), or None to reallocate."""

    def __init__(self, runner, capture_graphs: Callable[[], None], weight_restore: str = "host_copy",
                 fixed: FixedAddresses | None = None):
        if weight_restore not in WEIGHT_RESTORE_MODES:
            raise ValueError(f"sleep_config.model_weights must be one of {list(WEIGHT_RESTORE_MODES)}, "
                             f"got {weight_restore!r}")
        self.runner = runner
        self.capture_graphs = capture_graphs
        self.weight_restore = weight_restore
        self.fixed = fixed
        self.released: set[str] = set()
        self._weights = list(runner.model.parameters())  # tied weights once
        self._buffers = list(runner.model.buffers())
        self._layouts: dict[int, tuple[torch.Size, torch.dtype]] = {}
        # One flat host buffer per kept group, allocated at its first release and reused by every later one (pinned
        # allocations of many GB cost seconds); the views into it by tensor.
        self._host_buffers: dict[str, torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}
        self._kv_layout: tuple[int, torch.dtype] | None = None
        self._graphs_stale = False  # the graphs were dropped with the weights or the cache, not by request
        self.graph_bytes = 0  # what the last capture took from the device (its reserved memory grew by)

    def capture(self) -> None:
        """Captures the decode graphs, measuring what they take."""
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        self.capture_graphs()
        if cuda:
            self.graph_bytes = max(0, torch.cuda.memory_reserved(self.device) - before)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def status(self) -> dict[str, dict]:
        """Per tag: the bytes it holds when resident, and whether it is."""
        sizes = {"model_weights": self._layout_bytes(self._weights), "kv_cache": self._kv_bytes(),
                 "cuda_graph": self.graph_bytes, "model": self._layout_bytes(self._buffers)}
        return {tag: {"bytes": sizes[tag], "resident": tag not in self.released} for tag in TAGS}

    def release(self, tags: list[str]) -> None:
        tags = [tag for tag in check_tags(tags) if tag not in self.released]
        if not tags:
            return
        moved = {"cuda_graph"} if self.fixed is not None else {"model_weights", "kv_cache", "cuda_graph"}
        if moved & set(tags) and self.runner.graphs is not None:
            self.runner.drop_graphs()  # they read the weights and the cache at their addresses
            self._graphs_stale = "cuda_graph" not in tags
        for tag in tags:
            if self.fixed is not None and tag in FIXED_TAGS:
                self.fixed.pause(tag)
            elif tag == "model_weights":
                self._free(tag, self._weights, keep=self.weight_restore == "host_copy")
            elif tag == "model":
                self._free(tag, self._buffers, keep=True)
            elif tag == "kv_cache":
                if self.runner.kv_caches:  # no local name for them: it would hold the cache past empty_cache below
                    first = self.runner.kv_caches[0][0]
                    self._kv_layout = (first.shape[0] - 1, first.dtype)
                    del first
                self.runner.kv_caches = []
            self.released.add(tag)
        if self.device.type == "cuda":
            gc.collect()  # dropped graphs sit in reference cycles that hold their pools and the cache's tensors
            torch.cuda.synchronize(self.device)
            if self.runner.graphs is None and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()  # 32 MB a stream on Hopper; kept graphs would replay into them
            torch.cuda.empty_cache()

    def resume(self, tags: list[str]) -> None:
        tags = [tag for tag in check_tags(tags) if tag in self.released]
        for tag in tags:
            if self.fixed is not None and tag in FIXED_TAGS:
                self.fixed.resume(tag)
                if tag == "kv_cache":
                    self.runner.zero_unwritten_kv()  # the pages come back with any contents
            elif tag == "model_weights":
                self._restore(self._weights)
            elif tag == "model":
                self._restore(self._buffers)
            elif tag == "kv_cache" and self._kv_layout is not None:
                self.runner.allocate_kv_cache(*self._kv_layout)
            self.released.discard(tag)
        wants_graphs = "cuda_graph" in tags or self._graphs_stale
        if wants_graphs and not self.released & {"model_weights", "kv_cache", "cuda_graph", "model"}:
            self.capture()
            self._graphs_stale = False

    def _free(self, group: str, tensors: list[torch.Tensor], keep: bool) -> None:
        tensors = [tensor for tensor in tensors if tensor.numel()]
        for tensor in tensors:
            self._layouts[id(tensor)] = (tensor.shape, tensor.dtype)
        if keep:
            views = self._host_views(group, tensors)
            for tensor, view in zip(tensors, views):
                view.copy_(tensor.data, non_blocking=True)
                self._host[id(tensor)] = view
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        for tensor in tensors:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def _host_views(self, group: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of `group`'s host buffer, one per tensor in order, each starting on a 256-byte boundary."""
        offsets, total = [], 0
        for tensor in tensors:
            offsets.append(total)
            total += -(-tensor.nbytes // 256) * 256
        buffer = self._host_buffers.get(group)
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._host_buffers[group] = buffer
        return [buffer[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
                for tensor, offset in zip(tensors, offsets)]

    def _restore(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            key = id(tensor)
            if key not in self._layouts:
                continue  # empty when released: nothing to bring back
            shape, dtype = self._layouts.pop(key)
            restored = torch.empty(shape, dtype=dtype, device=self.device)
            host = self._host.pop(key, None)
            if host is not None:
                restored.copy_(host, non_blocking=True)
            tensor.data = restored
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _layout_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of `tensors` when resident (released ones by the layout they had)."""
        layouts = (self._layouts.get(id(t), (t.shape, t.dtype)) if t.numel() == 0 else (t.shape, t.dtype)
                   for t in tensors)
        return sum(shape.numel() * dtype.itemsize for shape, dtype in layouts)

    def _kv_bytes(self) -> int:
        caches = self.runner.kv_caches
        if caches:
            return _bytes(t for pair in caches for t in pair)
        if self._kv_layout is None:
            return 0
        num_blocks, dtype = self._kv_layout
        return self.runner.kv_bytes_per_block(dtype) * (num_blocks + 1)


def process_device_bytes(device: torch.device) -> int | None:
    """What this process holds on `device` by the driver's count (NVML): the CUDA context and every allocation,
    not only the allocator's. None where NVML is missing or does not list the process (some containers)."""
    try:
        import pynvml
    except ImportError:
        return None
    import os

    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid():
                return process.usedGpuMemory
    except pynvml.NVMLError:
        return None
    return None
