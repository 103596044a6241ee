"""The batched LoRA product (kernels/lora.py) against each row's own adapter computed alone."""

from __future__ import annotations

import torch

from raylm.kernels.lora import add_lora


def test_rows_of_mixed_slots_and_none_each_get_their_own_adapter_per_fused_slice():
    generator = torch.Generator().manual_seed(0)
    slots, rank, in_features, sizes = 3, 8, 16, [12, 4, 4]  # a fused q / k / v layer
    lora_a = torch.randn(slots, len(sizes) * rank, in_features, generator=generator)
    lora_b = torch.randn(slots, sum(sizes), rank, generator=generator)
    lora_a[1, rank - 2 : rank] = 0  # slot 1's q adapter has a smaller rank, padded with zeros
    x = torch.randn(7, in_features, generator=generator)
    base = torch.randn(7, sum(sizes), generator=generator)
    row_slots = [2, -1, 0, 2, 1, -1, 0]
    groups = [(slot, torch.tensor([r for r, s in enumerate(row_slots) if s == slot])) for slot in (0, 1, 2)]
    out = add_lora(base.clone(), x, lora_a, lora_b, sizes, groups)
    for row, slot in enumerate(row_slots):
        expected = base[row].clone()
        if slot >= 0:
            offset = 0
            for index, size in enumerate(sizes):
                shrunk = lora_a[slot, index * rank : (index + 1) * rank] @ x[row]
                expected[offset : offset + size] += lora_b[slot, offset : offset + size] @ shrunk
                offset += size
        torch.testing.assert_close(out[row], expected)


def test_one_slot_for_every_row_adds_to_all_rows():
    generator = torch.Generator().manual_seed(1)
    lora_a = torch.randn(2, 4, 6, generator=generator)
    lora_b = torch.randn(2, 5, 4, generator=generator)
    x, base = torch.randn(3, 6, generator=generator), torch.randn(3, 5, generator=generator)
    out = add_lora(base.clone(), x, lora_a, lora_b, [5], [(1, None)])
    torch.testing.assert_close(out, base + (x @ lora_a[1].T) @ lora_b[1].T)
    assert torch.equal(add_lora(base.clone(), x, lora_a, lora_b, [5], []), base)
