"""The batched LoRA product: each row of a step adds the product of its own adapter (or none) to a linear layer's
output. The torch reference, which groups rows by adapter slot; correct on every device."""

from __future__ import annotations

import torch

# Rows of a step that use one adapter slot: (slot, their row indices, or None for every row).
SlotRows = tuple[int, torch.Tensor | None]


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slice_sizes: list[int],
             groups: list[SlotRows]) -> torch.Tensor:
    """Adds to `out` [T, out_features], in place, each group's (x[rows] @ A[slot]^T) @ B[slot]^T (the scaling is
    folded into B) and returns it.

    lora_a [slots, len(slice_sizes) * rank, in_features] and lora_b [slots, out_features, rank] hold adapters padded
    with zeros to `rank`. A fused layer's output is several projections side by side (slice_sizes, e.g. q, k and v):
    slice i's rows of B multiply ranks [i * rank, (i + 1) * rank) of the shrunk input, so each projection has an
    adapter of its own."""
    rank = lora_b.shape[-1]
    for slot, rows in groups:
        inputs = x if rows is None else x.index_select(0, rows)
        shrunk = inputs @ lora_a[slot].T
        b = lora_b[slot]
        if len(slice_sizes) == 1:
            delta = shrunk @ b.T
        else:
            parts, offset = [], 0
            for index, size in enumerate(slice_sizes):
                parts.append(shrunk[:, index * rank : (index + 1) * rank] @ b[offset : offset + size].T)
                offset += size
            delta = torch.cat(parts, dim=-1)
        if rows is None:
            out += delta
        else:
            out.index_add_(0, rows, delta)
    return out
