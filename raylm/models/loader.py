"""Building a model and filling its weights from safetensors, a .pt/.bin file, GGUF, or at random."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raylm.models.arch import ArchConfig
from raylm.models.bert import EncoderArch
from raylm.models.parallel import SINGLE, ParallelContext
from raylm.models.quantization import Fp8Weights
from raylm.models.registry import resolve_architecture
from raylm.models.source import ModelSource


@dataclass
class LoadedModel:
    model: nn.Module
    arch: ArchConfig | EncoderArch
    timings: dict[str, float] = field(default_factory=dict)


def load_hf_config(source: ModelSource, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(source.config_dir), trust_remote_code=trust_remote_code)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# safetensors' names of the dtypes checkpoints hold.
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class LazyTensor:
    """A checkpoint tensor not read yet: a rank reads only the slice its weight loader narrows to."""

    def __init__(self, handle, name: str):
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(self._slice.get_dtype())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, index) -> torch.Tensor:
        return self._handle.get_tensor(self._name) if index is Ellipsis else self._slice[index]


def _iter_safetensors(directory: Path) -> Iterator[tuple[str, LazyTensor]]:
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, LazyTensor(handle, name)


def _iter_pt(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in sorted([*directory.glob("*.bin"), *directory.glob("*.pt")]):
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


def _iter_checkpoint(source: ModelSource, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    if source.weights_format == "safetensors":
        return _iter_safetensors(source.weights_path)
    if source.weights_format == "pt":
        return _iter_pt(source.weights_path)
    raise ValueError(f"model {source.name!r} has no weight files (*.safetensors or *.bin)")


class DummyTensor:
    """A checkpoint tensor of random values: normal(0, 0.02) drawn whole on `device` from a seed of its own (the
    run's seed and the tensor's name), unit norms, zero biases. Every rank of every parallel layout draws the
    same tensor and narrows it to its shard, so dummy weights are one model whatever the TP / PP sizes."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self._device = device
        self._seed = seed

    def _full(self) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self._device)
        if self.name.endswith("norm.weight"):
            return tensor.fill_(1.0)
        if self.name.endswith("bias"):
            return tensor.zero_()
        generator = torch.Generator(device=self._device).manual_seed(self._seed * 1_000_003 + zlib.crc32(
            self.name.encode()))
        return tensor.normal_(0.0, 0.02, generator=generator)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._full().narrow(dim, start, length)

    def __getitem__(self, index) -> torch.Tensor:
        return self._full()[index]


def _dummy_checkpoint(hf_config: Any, dtype: torch.dtype, device: torch.device, seed: int,
                      encoder_only: bool = False) -> Iterator[tuple[str, DummyTensor]]:
    """Random tensors under the checkpoint names and shapes of `hf_config` (read off transformers' model built on
    the meta device, which allocates nothing; its base model for an encoder)."""
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        reference = (AutoModel if encoder_only else AutoModelForCausalLM).from_config(hf_config)
    for name, param in reference.named_parameters():
        yield name, DummyTensor(name, tuple(param.shape), dtype, device, seed)


def load_model(
    source: ModelSource,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    ctx: ParallelContext = SINGLE,
    seed: int = 0,
    encode_only: bool = False,
    fp8: Fp8Weights | None = None,
) -> LoadedModel:
    """Constructs the model for `hf_config` on `device` in `dtype` and loads this rank's weights. An encode_only
    engine never projects onto the vocabulary, so a checkpoint without an LM head (an embedding model's) loads. fp8
    (models/quantization.py: resolve_fp8_weights): the decoder layers' linear weights in FP8."""
    start = time.perf_counter()
    entry, arch = resolve_architecture(hf_config)
    if fp8 is not None:
        if entry.encoder_only:
            raise ValueError(f"quant_config.quant_algo='FP8' is for decoder models, not {arch.architecture}")
        arch = dataclasses.replace(arch, fp8=fp8)
    with _default_dtype(dtype), torch.device(device):
        model = entry.model_class(arch, max_positions, ctx)
    prepared = time.perf_counter()
    checkpoint = _dummy_checkpoint(hf_config, dtype, device, seed, entry.encoder_only) if load_format == "dummy" \
        else _iter_checkpoint(source, arch)
    loaded = model.load_weights(checkpoint)
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - loaded - ({"lm_head.weight"} if arch.tie_word_embeddings or encode_only else set()))
    if missing:
        raise ValueError(f"checkpoint of {source.name!r} lacks weights: {', '.join(missing[:8])}")
    populated = time.perf_counter()
    model.eval()
    timings = {
        "checkpoint_preparation_seconds": prepared - start,
        "weight_population_seconds": populated - prepared,
        "total_model_loading_seconds": populated - start,
    }
    return LoadedModel(model, arch, timings)
