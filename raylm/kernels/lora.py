"""The batched LoRA product: each row of a step adds the product of its own adapter (or none) to a linear layer's
output, in torch; correct on every device. add_lora groups rows by adapter slot (two matmuls per adapter: the
reference, and the cheaper where adapters have many rows each, as in prefill); add_lora_by_rows gathers each row's
adapter for it (two batched matmuls whatever the number of adapters: the cheaper for decode steps of a few rows per
adapter, where add_lora's per-adapter calls cost more than their arithmetic)."""

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


def add_lora_by_rows(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     slice_sizes: list[int], rows: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """add_lora's sums with each row's A and B gathered for it: `rows` (their indices; None for the first
    len(slots) rows, every row of an unpadded batch: a decode graph's padding rows past them add nothing) use
    adapter slots `slots` (one per row, int64 on x's device). Adds to `out` in place and returns it."""
    rank = lora_b.shape[-1]
    count = slots.shape[0]
    inputs = x[:count] if rows is None else x.index_select(0, rows)
    shrunk = torch.bmm(inputs.unsqueeze(1), lora_a.index_select(0, slots).transpose(1, 2))  # [rows, 1, slices * rank]
    b = lora_b.index_select(0, slots).transpose(1, 2)  # [rows, rank, out_features]
    if len(slice_sizes) == 1:
        delta = torch.bmm(shrunk, b)
    else:
        parts, offset = [], 0
        for index, size in enumerate(slice_sizes):
            parts.append(torch.bmm(shrunk[:, :, index * rank : (index + 1) * rank], b[:, :, offset : offset + size]))
            offset += size
        delta = torch.cat(parts, dim=-1)
    if rows is None:
        out[:count] += delta.squeeze(1)
    else:
        out.index_add_(0, rows, delta.squeeze(1))
    return out
