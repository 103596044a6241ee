"""GGUF checkpoints, converted once into an HF directory (config, tokenizer, float32 safetensors).

Dequantizing the tensors and converting the tokenizer take seconds, so the result is saved to a cache
directory keyed by the file's path, size and modification time; every later start (and every rank of
a multi-rank engine) reads the cached copy like any HF directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

# GGUF architectures whose q/k projections llama.cpp stores permuted for its interleaved RoPE.
_PERMUTED_QK_ARCHS = {"llama"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("RAYLM_CACHE_DIR", Path.home() / ".cache" / "raylm"))


def converted_dir(gguf_path: str) -> Path:
    """Directory holding the HF config and tokenizer converted from a GGUF file (made on first use)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoConfig, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        config.quantization_config = None
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)
        _save_weights(str(path), config, staging / "model.safetensors")
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def _unpermute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's per-head interleaving of the rotary halves in q/k projection rows."""
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def iter_gguf_weights(gguf_path: str, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) for every tensor of a GGUF file, dequantized."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_path)
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "llama"
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if arch in _PERMUTED_QK_ARCHS and name.endswith("q_proj.weight"):
            weights = _unpermute(weights, num_heads)
        elif arch in _PERMUTED_QK_ARCHS and name.endswith("k_proj.weight"):
            weights = _unpermute(weights, num_kv_heads)
        yield name, torch.from_numpy(np.array(weights, dtype=np.float32, order="C", copy=True))


def _save_weights(gguf_path: str, config, target: Path) -> None:
    from safetensors.torch import save_file

    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    tensors = dict(iter_gguf_weights(gguf_path, num_heads, num_kv_heads))
    save_file(tensors, str(target))
