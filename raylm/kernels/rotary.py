"""Rotary position embedding with default, linear and llama3 frequency scaling (torch reference)."""

from __future__ import annotations

import math

import torch
from torch import nn

from raylm.kernels.policy import KernelPolicy


def rope_inv_freq(head_dim: int, theta: float, rope_type: str = "default", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_position_embeddings: int | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, one per pair of head dimensions."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        old_context = original_max_position_embeddings or 8192
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by the factor, short ones kept; the band between is blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(in_band, blended, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions, from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at the given positions, [T, 1, D]: looked up once per forward, shared by all layers."""
        cos = self.cos_table.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 kernels: KernelPolicy = KernelPolicy()):
    """q: [T, Hq, D], k: [T, Hk, D]; cos_sin from RotaryEmbedding.cos_sin; the Triton kernel where the kernel
    policy `kernels` has it."""
    cos, sin = cos_sin
    if kernels.on_triton(q):
        from raylm.kernels.triton_ops import rotary_embedding

        return rotary_embedding(q, k, cos, sin)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
