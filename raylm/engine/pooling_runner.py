"""The pooling runner: an encode_only engine's model on one device. A step packs whole prompts into one forward
without a KV cache (kernels/packed_attention.py: both ways for an encoder, causal for a decoder), then pools each
prompt's final hidden states into its embedding as the engine's PoolingSpec says (raylm/pooling.py)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from raylm.config import KernelConfig
from raylm.kernels.packed_attention import PackedAttention
from raylm.kernels.policy import choose_kernel_policy, set_kernel_policy
from raylm.pooling import PoolingSpec

# An encoder runs every layer over padded rows when padding adds less than this fraction of rows, rather than pad
# and unpad q, k, v and the output in each layer (kernels/packed_attention.py). Measured on the CPU with
# all-MiniLM-L6-v2 at batch 32: the per-layer padding took about a fifth of the forward.
PAD_INPUTS_BELOW = 0.2


def pool(hidden: torch.Tensor, seq_lens: list[int], spec: PoolingSpec) -> torch.Tensor:
    """One embedding per sequence ([B, hidden_size], float32) from packed hidden states [T, hidden_size]: the mean
    of a sequence's rows, its first row (cls) or its last (last), scaled to unit norm when spec.normalize."""
    hidden = hidden.float()
    lengths = torch.tensor(seq_lens, device=hidden.device)
    ends = lengths.cumsum(0)
    if spec.pooling_type == "mean":
        sequence = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lengths)
        sums = hidden.new_zeros(len(seq_lens), hidden.shape[1]).index_add_(0, sequence, hidden)
        pooled = sums / lengths[:, None]
    elif spec.pooling_type == "cls":
        pooled = hidden[ends - lengths]
    elif spec.pooling_type == "last":
        pooled = hidden[ends - 1]
    else:
        raise ValueError(f"pooling_type must be one of 'mean', 'cls', 'last', got {spec.pooling_type!r}")
    return F.normalize(pooled, p=2, dim=-1) if spec.normalize else pooled


class PoolingRunner:
    """Owns the model of an encode_only engine and turns batches of whole prompts into embeddings."""

    def __init__(self, model: nn.Module, device: torch.device, pooling: PoolingSpec,
                 kernel_config: KernelConfig | None = None):
        self.model = model
        self.device = device
        self.pooling = pooling
        self.encoder = getattr(model, "encoder_only", False)
        # A decoder's layers take (k, v) caches: it has none here, and its attention never reads them.
        self._no_caches = None if self.encoder else [(None, None)] * model.num_local_layers
        if not self.encoder:
            config = kernel_config or KernelConfig()
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            set_kernel_policy(model, choose_kernel_policy(device, weight_bytes, config.triton, decode_gemv=False,
                                                          pdl="off"))

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        """The embeddings of whole prompts, one forward for all: [len(prompts), hidden_size] float32 on the host."""
        seq_lens = [len(prompt) for prompt in prompts]
        input_ids = torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(length) for length in seq_lens]).to(self.device)
        meta = PackedAttention.build(seq_lens, causal=not self.encoder, device=self.device,
                                     pad_inputs_below=PAD_INPUTS_BELOW if self.encoder else 0.0)
        if self.encoder:
            hidden = self.model(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self._no_caches, meta)
        return pool(hidden, seq_lens, self.pooling).cpu()
