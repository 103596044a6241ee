"""Decoder-only transformer of the Llama family: Llama 2/3/3.1, Mistral, TinyLlama, SmolLM2, Qwen2/2.5
(qkv bias), Qwen3 (q/k RMSNorm per head) and Qwen3-MoE (mixture-of-experts MLPs). Pre-norm blocks,
grouped-query attention, rotary positions, gated SiLU MLP.

Under pipeline parallelism a rank builds only its stage's layers (the others are parameterless
placeholders, so parameter names keep their global layer index); the first stage embeds, the last
normalises and projects onto the vocabulary."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from raylm.kernels.activation import gated_activation
from raylm.kernels.attention import AttentionMetadata
from raylm.kernels.fp8 import FP8_DTYPE
from raylm.kernels.norm import RMSNorm
from raylm.kernels.policy import KernelPolicy
from raylm.kernels.rotary import RotaryEmbedding, rope_inv_freq
from raylm.models.arch import ArchConfig
from raylm.models.moe import MoEBlock
from raylm.models.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    Unreduced,
    VocabParallelEmbedding,
    default_weight_loader,
)
from raylm.models.quantization import (
    UNUSED_SUFFIXES,
    checkpoint_scale,
    is_fp8,
    kv_tensor_scale,
    quantize_checkpoint_weight,
    scale_param_name,
    split_scale_name,
)

KVCache = tuple[torch.Tensor, ...]  # (k_cache, v_cache), an FP8 cache's (k_cache, v_cache, k_scale, v_scale)


class Attention(nn.Module):
    kernels = KernelPolicy()  # the model's kernel policy (kernels/policy.py: set_kernel_policy)

    def __init__(self, arch: ArchConfig, ctx: ParallelContext):
        super().__init__()
        self.head_dim = arch.head_dim
        fp8 = arch.fp8 is not None
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, ctx, fp8
        )
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, arch.o_bias, ctx, fp8)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = arch.head_dim**-0.5
        # An FP8-KV checkpoint's static (k_scale, v_scale): the per-tensor scales of an FP8 cache
        # (kv_cache_config.fp8_scales='per_tensor'; models/quantization.py: kv_tensor_scale)
        self.kv_tensor_scales: tuple[float, float] | None = None

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, defer_reduce: bool = False) -> torch.Tensor | Unreduced:
        adds = self.q_norm is None and meta.adds_qkv_products
        qkv = self.qkv_proj(hidden, defer_add=True) if adds else self.qkv_proj(hidden)
        # An FP8 cache carries its scales after the keys and values (the torch backend's attend takes them).
        extra = {"kv_scales": kv_cache[2:]} if len(kv_cache) > 2 else {}
        if hasattr(qkv, "products"):  # LoRA products (models/lora.py's PendingProducts): the decode kernel adds them
            qkv, extra["qkv_addends"] = qkv.out, self._heads(qkv.products)
        q, k, v = self._heads(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = meta.attend(q, k, v, kv_cache[0], kv_cache[1], self.scale, rope=rope, kernels=self.kernels, **extra)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim), defer_reduce)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, H_kv, D]: views of the qkv layer's output."""
        q, k, v = self.qkv_proj.split(qkv)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))


class MLP(nn.Module):
    kernels = KernelPolicy()  # the model's kernel policy (kernels/policy.py: set_kernel_policy)

    def __init__(self, arch: ArchConfig, ctx: ParallelContext):
        super().__init__()
        size = arch.intermediate_size
        fp8 = arch.fp8 is not None
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [size, size], arch.mlp_bias, ctx, fp8)
        self.down_proj = RowParallelLinear(size, arch.hidden_size, arch.mlp_bias, ctx, fp8)
        self.act = gated_activation(arch.hidden_act)
        self.silu = arch.hidden_act == "silu"

    def forward(self, x: torch.Tensor, defer_reduce: bool = False) -> torch.Tensor | Unreduced:
        gate_up = self.gate_up_proj
        # SiLU-mul in the GEMV's epilogue where no adapter adds to gate_up's output (an adapter's products join that
        # output first, and the SiLU-mul runs on its own)
        adds = gate_up.lora is not None and gate_up.lora.adds()
        if self.silu and not adds and self.kernels.gemv_applies(x, gate_up.weight):
            from raylm.kernels.triton_gemv import gemv_silu_mul

            activated = gemv_silu_mul(x, gate_up.weight, gate_up.bias, weight_scale=gate_up.weight_scale,
                                      input_mode=self.kernels.gemv_input_mode(gate_up.weight_scale, x),
                                      pdl=self.kernels.pdl, tiles=self.kernels.gemv_tiles,
                                      prefetch=self.kernels.gemv_prefetch)
            return self.down_proj(activated, defer_reduce)
        # LoRA products computed beside the GEMV may come back unadded (PendingProducts): the SiLU-mul adds them
        gate_up_out = gate_up(x, defer_add=True) if adds and self.silu else gate_up(x)
        pending = gate_up_out.products if hasattr(gate_up_out, "products") else None
        out = gate_up_out.out if pending is not None else gate_up_out
        if self.silu and self.kernels.on_triton(out):
            from raylm.kernels import triton_ops

            size = out.shape[-1] // 2  # the down projection's input quantized where it can be
            if self.down_proj.takes_fp8_rows(out[..., :size]):
                out = out if pending is None else gate_up_out.materialize()
                return self.down_proj(triton_ops.silu_and_mul_fp8(out, self.kernels.pdl), defer_reduce)
            return self.down_proj(triton_ops.silu_and_mul(out, self.kernels.pdl, extra=pending), defer_reduce)
        if pending is not None:
            out = gate_up_out.materialize()
        return self.down_proj(self.act(out, self.kernels), defer_reduce)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, index: int, ctx: ParallelContext):
        super().__init__()
        self.self_attn = Attention(arch, ctx)
        self.mlp = MoEBlock(arch, ctx) if arch.is_moe_layer(index) else MLP(arch, ctx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Where the qkv and gate / up projections quantize their input to FP8, the norms before them write it.
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        if isinstance(self.mlp, MLP):
            self.post_attention_layernorm.feeds(self.mlp.gate_up_proj)

    def forward(self, rope, hidden, residual, kv_cache, meta, defer_reduce: bool = False):
        """With defer_reduce, the o and down projections return Unreduced partial sums, which the RMSNorm after
        each reduces (the layer's output too: the next layer's input norm, or the model's, takes it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta, defer_reduce)
        if isinstance(self.mlp, MLP):
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden, defer_reduce), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A layer that lives on another pipeline stage."""


Intermediate = tuple[torch.Tensor, torch.Tensor]  # (hidden, residual) passed between pipeline stages


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
    # an expert projection's checkpoint name -> (our stacked parameter of the layer's experts, half of it)
    expert_params = {
        "gate_proj": ("w13", 0),
        "up_proj": ("w13", 1),
        "gate_up_proj": ("w13", None),
        "down_proj": ("w2", None),
    }

    def __init__(self, arch: ArchConfig, max_positions: int, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.arch = arch
        rope = arch.rope
        inv_freq = rope_inv_freq(arch.head_dim, rope.theta, rope.rope_type, rope.factor, rope.low_freq_factor,
                                 rope.high_freq_factor, rope.original_max_position_embeddings)
        self.ctx = ctx
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, inv_freq)
        self.start_layer, self.end_layer = ctx.layer_range(arch.num_layers)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, ctx) \
            if ctx.is_first_stage else None
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, ctx) if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if ctx.is_last_stage else None
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, ctx) if ctx.is_last_stage else None
        if arch.tie_word_embeddings and ctx.pp_size == 1:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    @property
    def local_layers(self) -> list[DecoderLayer]:
        return list(self.layers[self.start_layer : self.end_layer])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, intermediate: Intermediate | None = None) -> torch.Tensor | Intermediate:
        """input_ids, positions: [T]; kv_caches: this stage's layers. The last stage returns the final hidden
        states [T, hidden_size]; earlier stages return (hidden, residual) for the next stage."""
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        defer_reduce = self.ctx.defer_reduce
        for layer, kv_cache in zip(self.local_layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta, defer_reduce)
        if self.norm is None:
            if isinstance(hidden, Unreduced):
                hidden = hidden.reduce()
            if hasattr(hidden, "products"):  # LoRA products still to add (models/lora.py's PendingProducts)
                hidden = hidden.materialize()
            return hidden, residual if residual is not None else torch.zeros_like(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def _local_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills on this rank, or None when it belongs elsewhere."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("layers."):
            index = int(name.split(".", 2)[1])
            return name if self.start_layer <= index < self.end_layer else None
        if name.startswith("embed_tokens."):
            if self.embed_tokens is not None:
                return name
            # A tied LM head on a later stage than the embedding loads the embedding's weights itself.
            return "lm_head.weight" if self.lm_head is not None and self.arch.tie_word_embeddings else None
        if name.startswith("lm_head."):
            if self.lm_head is None or (self.arch.tie_word_embeddings and self.ctx.pp_size == 1):
                return None
            return name
        if name.startswith("norm."):
            return name if self.norm is not None else None
        return name

    def _fused_name(self, name: str) -> tuple[str, object]:
        """Maps a checkpoint name onto a fused parameter: (parameter name, shard id). Experts come under either
        name: one expert's (layers.L.mlp.experts.E.{gate,up,down}_proj.weight) or every expert's, stacked
        (layers.L.mlp.experts.{gate_up,down}_proj)."""
        if ".mlp.experts." in name:
            prefix, rest = name.split(".experts.", 1)
            parts = rest.split(".")
            expert, projection = None, None
            if len(parts) == 3 and parts[0].isdigit():
                expert, projection = int(parts[0]), parts[1]
            elif len(parts) == 1:
                projection = parts[0]
            if projection in self.expert_params:
                target, half = self.expert_params[projection]
                return f"{prefix}.{target}", (expert, half)
        for ckpt_name, (fused_name, fused_shard) in self.stacked_params.items():
            if f".{ckpt_name}." in name:
                return name.replace(ckpt_name, fused_name), fused_shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors (HF names) into this rank's parameters; returns the names loaded.

        Tensors may be lazy slices (anything with .shape, .dtype and .narrow): loaders read only this rank's shard,
        except where FP8 weights are quantized as they load (models/quantization.py), which reads each whole.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()

        def load(name: str, tensor, shard_id: object) -> None:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)

        for checkpoint_name, tensor in weights:
            name = self._local_name(checkpoint_name)
            if name is not None and (found := kv_tensor_scale(name, tensor)) is not None:
                attention, which, scale = found
                attention = self.get_submodule(attention)
                k_scale, v_scale = attention.kv_tensor_scales or (1.0, 1.0)
                attention.kv_tensor_scales = (scale if "k" in which else k_scale, scale if "v" in which else v_scale)
                continue
            if name is None or (self.arch.fp8 is not None and name.endswith(UNUSED_SUFFIXES)):
                continue
            name, is_scale = split_scale_name(name)
            name, shard_id = self._fused_name(name)
            if name.endswith((".w13", ".w2")) and shard_id[0] is not None:
                block = self.get_submodule(name.rsplit(".", 1)[0])
                if not block.owns(shard_id[0]):
                    continue
            if is_scale:
                name, tensor = scale_param_name(name), checkpoint_scale(checkpoint_name, tensor)
            if name not in params:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no parameter in "
                                 f"{self.arch.architecture}")
            if not is_scale and params[name].dtype == FP8_DTYPE and not is_fp8(tensor):
                stacked_gate_up = name.endswith(".w13") and shard_id[0] is None
                tensor, scale = quantize_checkpoint_weight(tensor, params[name].device, self.arch.fp8.per_tensor,
                                                           stacked_gate_up)
                load(scale_param_name(name), scale, shard_id)
            elif not is_scale and is_fp8(tensor) and params[name].dtype != FP8_DTYPE:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} is in FP8, but {name} is not: only the "
                                 "decoder layers' linear weights are FP8 (quant_config.quant_algo='FP8')")
            load(name, tensor, shard_id)
        return loaded
