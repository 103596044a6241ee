"""Weight transfer for RL: how a trainer hands new weights to the engine's workers without copying them.

`AsyncLLM.update_weights(weights)` takes TensorRT-LLM's form: `{device_uuid: value}`, where a worker picks the
value for its own GPU. The trainer makes the value out of IPC handles (`tensor_handle`: CUDA IPC for GPU tensors,
shared memory for CPU ones); to send many small tensors through one handle it packs them into one flat buffer
(`pack_bucket`); to fit `dict[str, str]` it encodes the value as a base64 string (`encode_payload`). The worker calls
`weights_for_device(weights, its_uuid)` and gets named tensors that alias the trainer's memory: it copies them into
its parameters while the trainer keeps the sources alive and unchanged.

A string payload is unpickled with an allowlist (`decode_payload`) so that it can rebuild tensors and nothing else.
CPU tensors are shared through file descriptors that a process may take once, and only a process started by the
trainer through multiprocessing may take them; for unrelated processes (Ray actors) call
`torch.multiprocessing.set_sharing_strategy("file_system")` in the trainer first.

Only torch and the standard library are imported, so a trainer's process can use this module without the engine.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import math
import multiprocessing.resource_sharer
import pickle
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch._utils
import torch.storage
from torch.multiprocessing import reductions

BUCKET_ALIGNMENT = 256  # bytes between entry starts: every dtype's view stays aligned, as CUDA kernels expect

TensorHandle = tuple[Callable[..., Any], tuple[Any, ...]]
BucketEntry = tuple[str, str, tuple[int, ...], int]  # (name, dtype name, shape, offset in bytes)
NamedTensors = list[tuple[str, torch.Tensor]]

_REBUILD_FUNCTIONS = {
    reductions: ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_meta_tensor", "rebuild_storage_fd",
                 "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
                 "rebuild_typed_storage_child"),
    torch._utils: ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter"),
}
_REBUILD_GLOBALS = {
    (module.__name__, name): getattr(module, name) for module, names in _REBUILD_FUNCTIONS.items() for name in names
}
_REBUILD_CALLABLES = frozenset(_REBUILD_GLOBALS.values())
# Every global a tensor handle's pickle names, by (module, name); dtypes and storage classes are matched by kind.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **_REBUILD_GLOBALS,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("multiprocessing.resource_sharer", "DupFd"): multiprocessing.resource_sharer.DupFd,
    ("collections", "OrderedDict"): OrderedDict,
    **{("builtins", t.__name__): t for t in (dict, list, tuple, set, frozenset, bytes, bytearray, str, int, float,
                                             bool, complex)},
}
_STORAGE_MODULES = {"torch": torch, "torch.storage": torch.storage}  # where dtypes and storage classes live
_STORAGES = (torch.storage.TypedStorage, torch.storage.UntypedStorage)
# The receiver's index for the same GPU can differ from the sender's (CUDA_VISIBLE_DEVICES), so it may replace it.
_CUDA_DEVICE_ARG = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters).index("storage_device")


def tensor_handle(tensor: torch.Tensor) -> TensorHandle:
    """A `(rebuild_function, args)` pair that another process turns back into a tensor aliasing this one's memory.

    GPU tensors travel as CUDA IPC handles, which only another process can open. A CPU tensor's storage moves to
    shared memory when the handle is pickled by `encode_payload` (or by torch.multiprocessing). Keep `tensor` alive
    until the receiver is done.
    """
    return reductions.reduce_tensor(tensor)


def open_handle(handle: TensorHandle, device_index: int | None = None) -> torch.Tensor:
    """Rebuilds the tensor a `tensor_handle` describes; `device_index` puts a CUDA handle on this process's index
    of that GPU. Refuses, with a ValueError, a handle whose function is not one of torch's rebuild functions."""
    if not (isinstance(handle, (tuple, list)) and len(handle) == 2 and isinstance(handle[1], (tuple, list))):
        raise TypeError(f"a tensor handle must be a (rebuild_function, args) pair, got {_describe(handle)}")
    rebuild, args = handle
    if not any(rebuild is allowed for allowed in _REBUILD_CALLABLES):
        name = f"{getattr(rebuild, '__module__', '?')}.{getattr(rebuild, '__qualname__', repr(rebuild))}"
        raise ValueError(f"a tensor handle's function must be one of torch's rebuild functions, got {name}")
    if device_index is not None and rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:_CUDA_DEVICE_ARG], device_index, *args[_CUDA_DEVICE_ARG + 1:])
    tensor = rebuild(*args)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a tensor handle must rebuild a tensor, but {rebuild.__name__} built {_describe(tensor)}")
    return tensor


@dataclass
class WeightBucket:
    """Many tensors copied into one flat uint8 buffer on their device, so that one handle carries them all."""

    flat: torch.Tensor
    entries: list[BucketEntry]

    def payload(self) -> dict[str, Any]:
        """The picklable form `weights_for_device` opens: the buffer's handle and the entries."""
        return {"bucket": tensor_handle(self.flat), "entries": list(self.entries)}


def pack_bucket(named_tensors: NamedTensors) -> WeightBucket:
    """Copies tensors of any dtypes and shapes, all on one device, into one buffer on that device, each entry
    starting on a multiple of BUCKET_ALIGNMENT bytes."""
    if not named_tensors:
        raise ValueError("pack_bucket needs at least one (name, tensor) pair, got none")
    first_name, first = named_tensors[0]
    entries: list[BucketEntry] = []
    offset = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"pack_bucket takes dense tensors, but {name!r} is {_describe(tensor)}")
        if tensor.device != first.device:
            raise ValueError(f"a bucket's tensors must share one device: {first_name!r} is on {first.device}, "
                             f"{name!r} on {tensor.device}")
        entries.append((name, _dtype_name(tensor.dtype), tuple(tensor.shape), offset))
        offset += -(-tensor.nbytes // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
    flat = torch.empty(offset, dtype=torch.uint8, device=first.device)
    with torch.no_grad():
        for (_, tensor), (_, _, shape, start) in zip(named_tensors, entries):
            _entry_view(flat, tensor.dtype, shape, start).copy_(tensor)
    return WeightBucket(flat, entries)


def unpack_bucket(flat: torch.Tensor, entries: list[BucketEntry]) -> NamedTensors:
    """The named tensors a bucket holds, as views into `flat` (no copies). Raises ValueError for an entry that is
    malformed, names an unknown dtype, is misaligned, overlaps another or reaches past the buffer."""
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1 or flat.stride() != (1,):
        raise TypeError(f"a bucket's buffer must be a contiguous 1-D uint8 tensor, got {_describe(flat)}")
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"bucket entries must be a list, got {_describe(entries)}")
    named, spans = [], []
    for index, entry in enumerate(entries):
        name, dtype, shape, offset = _checked_entry(index, entry)
        end = offset + math.prod(shape) * dtype.itemsize
        if end > flat.numel():
            raise ValueError(f"bucket entry {index} ({name!r}) spans bytes [{offset}, {end}) but the buffer holds "
                             f"{flat.numel()} bytes")
        named.append((name, _entry_view(flat, dtype, shape, offset)))
        if end > offset:
            spans.append((offset, end, name))
    spans.sort()
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"bucket entries {name!r} and {next_name!r} overlap at byte {start}")
    return named


def encode_payload(obj: Any) -> str:
    """`obj` (handles, bucket payloads) as base64 text, pickled the way torch.multiprocessing pickles, which puts
    CPU storages in shared memory."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_payload(text: str) -> Any:
    """Reverses `encode_payload`. The unpickler loads only what tensor handles need (torch's rebuild functions,
    storage classes, dtypes, sizes, devices, plain containers) and raises pickle.UnpicklingError for anything else,
    so a payload cannot run arbitrary code."""
    if not isinstance(text, str):
        raise TypeError(f"a weight payload must be a base64 str, got {_describe(text)}")
    try:
        data = base64.b64decode(text, validate=True)
    except binascii.Error as error:
        raise ValueError(f"a weight payload must be base64 text: {error}") from error
    return _HandleUnpickler(io.BytesIO(data)).load()


def weights_for_device(weights: dict, device_id: str, device_index: int | None = None) -> NamedTensors:
    """This device's named tensors from an `update_weights` argument `{device_id: value}`.

    A value is a list of `(name, handle)` pairs, a bucket payload dict, a list mixing both, or a base64 string
    (`encode_payload`) of any of those. `device_index` is this process's index of the GPU (see `open_handle`).
    """
    if not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict mapping device ids to weight handles, got {_describe(weights)}")
    if device_id not in weights:
        raise ValueError(f"weights hold no entry for device {device_id!r}; devices present: "
                         f"{sorted(map(str, weights))}")
    value = weights[device_id]
    where = f"weights[{device_id!r}]"
    if isinstance(value, str):
        value = decode_payload(value)
    if isinstance(value, dict):
        return _open_bucket(value, where, device_index)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where} must be a list of (name, handle) pairs, a bucket payload dict, or a base64 string "
                        f"of either, got {_describe(value)}")
    named = []
    for index, item in enumerate(value):
        item_where = f"{where}[{index}]"
        if isinstance(item, dict):
            named.extend(_open_bucket(item, item_where, device_index))
        elif isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str):
            named.append((item[0], _open_at(item[1], f"{item_where} ({item[0]!r})", device_index)))
        else:
            raise TypeError(f"{item_where} must be a (name, handle) pair or a bucket payload dict, "
                            f"got {_describe(item)}")
    return named


def _open_bucket(payload: dict, where: str, device_index: int | None) -> NamedTensors:
    missing = sorted({"bucket", "entries"} - payload.keys())
    if missing:
        raise ValueError(f"{where} is a dict, so it must be a bucket payload, but it lacks {missing}")
    return unpack_bucket(_open_at(payload["bucket"], f"{where}['bucket']", device_index), payload["entries"])


def _open_at(handle: Any, where: str, device_index: int | None) -> torch.Tensor:
    try:
        return open_handle(handle, device_index)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: {error}") from error


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED_GLOBALS.get((module, name))
        if found is None and module in _STORAGE_MODULES and name.isidentifier():
            candidate = getattr(_STORAGE_MODULES[module], name, None)
            if isinstance(candidate, torch.dtype) or (isinstance(candidate, type) and issubclass(candidate, _STORAGES)):
                found = candidate
        if found is None:
            raise pickle.UnpicklingError(f"a weight payload may only hold tensor handles; it refers to {module}.{name}")
        return found


def _checked_entry(index: int, entry: Any) -> tuple[str, torch.dtype, tuple[int, ...], int]:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 4):
        raise ValueError(f"bucket entry {index} must be (name, dtype_name, shape, offset_bytes), got {entry!r}")
    name, dtype_name, shape, offset = entry
    if not isinstance(name, str):
        raise ValueError(f"bucket entry {index}: name must be a str, got {_describe(name)}")
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) and dtype_name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"bucket entry {index} ({name!r}): dtype_name must name a torch dtype, got {dtype_name!r}")
    if not (isinstance(shape, (list, tuple)) and all(_is_count(size) for size in shape)):
        raise ValueError(f"bucket entry {index} ({name!r}): shape must be a sequence of ints >= 0, got {shape!r}")
    if not _is_count(offset) or offset % BUCKET_ALIGNMENT:
        raise ValueError(f"bucket entry {index} ({name!r}): offset_bytes must be an int >= 0 and a multiple of "
                         f"{BUCKET_ALIGNMENT}, got {offset!r}")
    return name, dtype, tuple(shape), offset


def _entry_view(flat: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return flat[offset:offset + nbytes].view(dtype).view(shape)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.layout} {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"a {type(value).__name__}"
