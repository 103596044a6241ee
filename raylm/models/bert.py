"""BERT as an encoder for embeddings (HF `BertModel`, e.g. all-MiniLM-L6-v2): word, absolute position and token
type embeddings, then post-LayerNorm encoder layers (self-attention over the whole prompt, a GELU MLP, each added
to its input and normalised).

An encoder attends in both directions, so a token's state depends on every token of its prompt, later ones too:
nothing can be cached for a continuation, and a prompt is computed whole, in one step. The model therefore runs
without a KV cache, over packed whole prompts (kernels/packed_attention.py), and only in encode_only engines
(engine/pooling_engine.py). Every token is of type 0: a single segment, as sentence-transformers encodes a text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raylm.kernels.packed_attention import PackedAttention
from raylm.models.arch import config_dtype

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# HF checkpoint name parts -> ours, within encoder.layer.N (attention.self.{query,key,value} go to the fused qkv).
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "output_norm",
}
_QKV = {"query": 0, "key": 1, "value": 2}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
}
# Checkpoint tensors an encoder for embeddings does not use: BERT's pooler and pre-training heads.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


@dataclass(frozen=True)
class EncoderArch:
    """The shape of a BERT encoder, read once from its HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    hidden_act: str
    torch_dtype: torch.dtype | None = None
    tie_word_embeddings: bool = False  # an encoder has no LM head to tie

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def encoder_arch_from_hf(hf_config: Any, architecture: str) -> EncoderArch:
    """Reads an HF BertConfig; a feature this encoder lacks is a ValueError naming it."""
    position_type = getattr(hf_config, "position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type {position_type!r} is not supported for {architecture}; "
                         "supported: absolute")
    if hf_config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported for {architecture}; supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))}")
    return EncoderArch(
        architecture=architecture,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        layer_norm_eps=float(hf_config.layer_norm_eps),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        type_vocab_size=int(getattr(hf_config, "type_vocab_size", 2)),
        hidden_act=hf_config.hidden_act,
        torch_dtype=config_dtype(hf_config),
    )


class BertLayer(nn.Module):
    """Self-attention, then the MLP; each added to its input and LayerNorm-ed after (post-norm)."""

    def __init__(self, arch: EncoderArch):
        super().__init__()
        size = arch.hidden_size
        self.num_heads = arch.num_heads
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv = nn.Linear(size, 3 * size)  # query, key and value in one matmul
        self.attn_out = nn.Linear(size, size)
        self.attn_norm = nn.LayerNorm(size, eps=arch.layer_norm_eps)
        self.intermediate = nn.Linear(size, arch.intermediate_size)
        self.output = nn.Linear(arch.intermediate_size, size)
        self.output_norm = nn.LayerNorm(size, eps=arch.layer_norm_eps)
        self.act = _ACTIVATIONS[arch.hidden_act]

    def forward(self, hidden: torch.Tensor, meta: PackedAttention) -> torch.Tensor:
        q, k, v = self.qkv(hidden).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        attn = meta.attend(q, k, v, None, None, self.scale)
        hidden = self.attn_norm(hidden + self.attn_out(attn.reshape(hidden.shape)))
        return self.output_norm(hidden + self.output(self.act(self.intermediate(hidden))))


class BertModel(nn.Module):
    """A BERT encoder over packed whole prompts: final hidden states, one row per token."""

    encoder_only = True

    def __init__(self, arch: EncoderArch, max_positions: int, ctx: Any = None):
        super().__init__()
        if max_positions > arch.max_position_embeddings:
            raise ValueError(f"max_seq_len must be <= {arch.max_position_embeddings} ({arch.architecture}'s "
                             f"max_position_embeddings), got {max_positions}")
        if ctx is not None and ctx.tp_size * ctx.pp_size > 1:
            raise ValueError(f"{arch.architecture} runs on one device: tensor_parallel_size and "
                             "pipeline_parallel_size must be 1")
        self.arch = arch
        self.word_embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.position_embeddings = nn.Embedding(arch.max_position_embeddings, arch.hidden_size)
        self.token_type_embeddings = nn.Embedding(arch.type_vocab_size, arch.hidden_size)
        self.embed_norm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(arch) for _ in range(arch.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PackedAttention) -> torch.Tensor:
        """input_ids, positions: [T] (positions restart at 0 for each prompt). Returns [T, hidden_size]."""
        hidden = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                  + self.token_type_embeddings.weight[0])
        hidden = meta.pad(self.embed_norm(hidden))
        for layer in self.layers:
            hidden = layer(hidden, meta)
        return meta.unpad(hidden)

    @staticmethod
    def _local_name(name: str) -> tuple[str, int | None] | None:
        """Our parameter for a checkpoint tensor, and which third of the fused qkv it fills; None when unused."""
        name = name.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")
        if name.startswith(_UNUSED_PREFIXES):
            return None
        module, _, kind = name.rpartition(".")
        if module in _EMBEDDING_NAMES:
            return f"{_EMBEDDING_NAMES[module]}.{kind}", None
        if not module.startswith("encoder.layer."):
            return name, None
        index, _, part = module.removeprefix("encoder.layer.").partition(".")
        if part.startswith("attention.self."):
            projection = part.removeprefix("attention.self.")
            if projection in _QKV:
                return f"layers.{index}.qkv.{kind}", _QKV[projection]
        if part in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[part]}.{kind}", None
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copies checkpoint tensors (HF names, lazy or not) into the parameters; returns the names filled (the
        fused qkv once all three of its parts came)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        qkv_parts: dict[str, set[int]] = {}
        for checkpoint_name, tensor in weights:
            local = self._local_name(checkpoint_name)
            if local is None:
                continue
            name, third = local
            if name not in params:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no parameter in {self.arch.architecture}")
            param = params[name]
            target = param.data if third is None else param.data.chunk(3, dim=0)[third]
            value = tensor[...]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(target.shape)}")
            target.copy_(value)
            if third is None:
                loaded.add(name)
            else:
                qkv_parts.setdefault(name, set()).add(third)
                if len(qkv_parts[name]) == 3:
                    loaded.add(name)
        return loaded
