"""Attention over whole sequences without a KV cache (torch SDPA), for encode_only engines.

A step's tokens are several prompts back to back ([T] rows). Each attends to its own tokens only: all of them
(bidirectional, encoders such as BERT) or those up to its own position (causal, decoders pooled for embeddings).
Nothing is kept for later steps, since a prompt is computed whole in one step. The rows are scattered into a
padded [B, L] layout for one SDPA call per layer, then gathered back. Where padding would add few rows (prompts of
similar lengths), a model may instead pad its rows once, at its input (`pad` and `unpad`), and run every layer over
the padded rows: its linear layers then compute those few rows too, but no layer scatters or gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raylm.kernels.policy import KernelPolicy
from raylm.kernels.rotary import apply_rotary


@dataclass
class PackedAttention:
    """The metadata of one step of packed whole sequences; models call `attend` as they call the paged one's."""

    seq_lens: list[int]
    causal: bool
    max_len: int
    padded_rows: torch.Tensor | None  # [T] row of each token in the padded [B * max_len] layout; None: no padding
    key_mask: torch.Tensor | None  # [B, 1, 1, max_len] real keys, for bidirectional attention over padded rows
    rows_padded: bool = False  # the model pads its rows at its input: q, k and v come in the padded layout
    adds_qkv_products = False  # attend takes no LoRA products to add (TritonAttentionMetadata's do)

    @classmethod
    def build(cls, seq_lens: list[int], causal: bool, device: torch.device,
              pad_inputs_below: float = 0.0) -> PackedAttention:
        """The metadata of sequences of seq_lens tokens; with pad_inputs_below > 0, the model's rows are padded at
        its input when padding adds less than that fraction of rows."""
        max_len = max(seq_lens)
        if all(length == max_len for length in seq_lens):
            return cls(seq_lens, causal, max_len, None, None)
        lengths = torch.tensor(seq_lens, device=device)
        positions = torch.arange(max_len, device=device)
        real = positions[None, :] < lengths[:, None]  # [B, max_len]
        rows = torch.arange(len(seq_lens) * max_len, device=device).view(len(seq_lens), max_len)[real]
        # Causal attention needs no mask: a sequence's padding comes after its tokens, which never look ahead.
        key_mask = None if causal else real[:, None, None, :]
        padding = 1 - sum(seq_lens) / (len(seq_lens) * max_len)
        return cls(seq_lens, causal, max_len, rows, key_mask, rows_padded=padding < pad_inputs_below)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """A model's input rows [T, ...] in the padded layout [B * max_len, ...] (zeros between sequences) when
        rows_padded, else as they are."""
        if not self.rows_padded:
            return x
        return x.new_zeros(len(self.seq_lens) * self.max_len, *x.shape[1:]).index_copy_(0, self.padded_rows, x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """A model's output rows back in the packed layout [T, ...]."""
        return x.index_select(0, self.padded_rows) if self.rows_padded else x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None,
               v_cache: torch.Tensor | None, scale: float, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
               kernels: KernelPolicy = KernelPolicy()) -> torch.Tensor:
        """q: [T, H_q, D]; k, v: [T, H_kv, D] (the caches are unused: there are none). Returns [T, H_q, D]."""
        if rope is not None:
            q, k = apply_rotary(q, k, rope, kernels)
        batch = len(self.seq_lens)
        query, key, value = (self._padded(x, batch) for x in (q, k, v))  # [B, H, L, D]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.key_mask,
                                             is_causal=self.causal, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch * self.max_len, q.shape[1], q.shape[2])
        return out if self.padded_rows is None or self.rows_padded else out.index_select(0, self.padded_rows)

    def _padded(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        heads, dim = x.shape[1], x.shape[2]
        if self.padded_rows is not None and not self.rows_padded:
            x = x.new_zeros(batch * self.max_len, heads, dim).index_copy_(0, self.padded_rows, x)
        return x.view(batch, self.max_len, heads, dim).transpose(1, 2)
