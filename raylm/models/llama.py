"""Decoder-only transformer of the Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM2, Qwen2/2.5
(qkv bias) and Qwen3 (q/k RMSNorm per head). Pre-norm blocks, grouped-query attention, rotary
positions, gated SiLU MLP."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from raylm.kernels.activation import gated_activation
from raylm.kernels.attention import AttentionMetadata, paged_attention
from raylm.kernels.norm import RMSNorm
from raylm.kernels.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from raylm.models.arch import ArchConfig
from raylm.models.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ParallelContext):
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, ctx
        )
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, arch.o_bias, ctx)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = arch.head_dim**-0.5

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ParallelContext):
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size], arch.mlp_bias, ctx)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, arch.mlp_bias, ctx)
        self.act = gated_activation(arch.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, ctx: ParallelContext):
        super().__init__()
        self.self_attn = Attention(arch, ctx)
        self.mlp = MLP(arch, ctx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The Llama-family causal LM over a paged KV cache."""

    # checkpoint projection name -> (our fused parameter prefix, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ArchConfig, max_positions: int, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.arch = arch
        rope = arch.rope
        inv_freq = rope_inv_freq(arch.head_dim, rope.theta, rope.rope_type, rope.factor, rope.low_freq_factor,
                                 rope.high_freq_factor, rope.original_max_position_embeddings)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, inv_freq)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, ctx)
        self.layers = nn.ModuleList(DecoderLayer(arch, ctx) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, ctx)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (HF names) into this rank's parameters; returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            shard_id = None
            for ckpt_name, (fused_name, fused_shard) in self.stacked_params.items():
                if f".{ckpt_name}." in name:
                    name, shard_id = name.replace(ckpt_name, fused_name), fused_shard
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter in {self.arch.architecture}")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor.to(param.dtype), shard_id)
            loaded.add(name)
        return loaded
