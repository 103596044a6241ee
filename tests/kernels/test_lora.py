"""The batched LoRA product (kernels/lora.py) against each row's own adapter computed alone."""

from __future__ import annotations

import pytest
import torch

from raylm.kernels.lora import add_lora, add_lora_by_rows
from raylm.models.lora import LoraBatch


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


@pytest.mark.parametrize("sizes", [[12, 4, 4], [9]])
def test_gathering_each_rows_adapter_gives_the_grouped_sums(sizes):
    generator = torch.Generator().manual_seed(2)
    slots, rank, in_features = 4, 8, 16
    lora_a = torch.randn(slots, len(sizes) * rank, in_features, generator=generator)
    lora_b = torch.randn(slots, sum(sizes), rank, generator=generator)
    x = torch.randn(6, in_features, generator=generator)
    base = torch.randn(6, sum(sizes), generator=generator)
    for row_slots in ([3, 0, 2, 0, 1, 3], [3, -1, 2, 0, -1, 3]):
        groups = [(slot, torch.tensor([r for r, s in enumerate(row_slots) if s == slot]))
                  for slot in sorted(set(row_slots) - {-1})]
        rows = [r for r, s in enumerate(row_slots) if s >= 0]
        by_rows = add_lora_by_rows(base.clone(), x, lora_a, lora_b, sizes,
                                   None if len(rows) == len(row_slots) else torch.tensor(rows),
                                   torch.tensor([row_slots[r] for r in rows]))
        torch.testing.assert_close(by_rows, add_lora(base.clone(), x, lora_a, lora_b, sizes, groups))
        assert torch.equal(by_rows[1], base[1]) == (row_slots[1] < 0)
    # A decode graph run uncaptured pads its rows: every real row gathers (rows None), the padding adds nothing.
    slots_of_real = torch.tensor([3, 0, 2, 0])
    padded = add_lora_by_rows(base.clone(), x, lora_a, lora_b, sizes, None, slots_of_real)
    real = add_lora_by_rows(base[:4].clone(), x[:4], lora_a, lora_b, sizes, None, slots_of_real)
    assert torch.equal(padded[:4], real) and torch.equal(padded[4:], base[4:])


def test_a_step_of_few_rows_an_adapter_gathers_and_one_of_many_groups():
    batch = LoraBatch()
    batch.set_rows([0, 1, 2, -1, 3], torch.device("cpu"))
    rows, slots = batch.by_rows
    assert rows.tolist() == [0, 1, 2, 4] and slots.tolist() == [0, 1, 2, 3]
    batch.set_rows([0, 1, 2, 3], torch.device("cpu"))
    assert batch.by_rows[0] is None
    batch.set_rows([0] * 9 + [1] * 9, torch.device("cpu"))  # 9 rows an adapter
    assert batch.by_rows is None and len(batch.groups) == 2
    batch.set_rows([2, 2, 2], torch.device("cpu"))  # one adapter: one matmul pair either way
    assert batch.by_rows is None


def _count_copies(batch: LoraBatch, monkeypatch) -> list:
    """The row indices the batch copies to the device, recorded as it makes them."""
    copies = []
    to_device = batch._to_device
    monkeypatch.setattr(batch, "_to_device", lambda indices: copies.append(indices.tolist()) or to_device(indices))
    return copies


def test_a_step_copies_the_row_groups_it_uses_and_no_others(monkeypatch):
    batch = LoraBatch()
    copies = _count_copies(batch, monkeypatch)
    batch.set_rows([0, 1, 2, -1, 3], torch.device("cpu"))
    assert batch.has_adapters and copies == []  # nothing copied before a layer asks
    assert batch.by_rows is not None and copies == [[0, 1, 2, 4], [0, 1, 2, 3]]
    batch.set_rows([0] * 9 + [-1] + [1] * 9, torch.device("cpu"))
    copies.clear()
    assert batch.by_rows is None and copies == []  # deciding against gathering copies nothing
    assert [slot for slot, _ in batch.groups] == [0, 1] and copies == [list(range(9)), list(range(10, 19))]
    assert len(batch.groups) == 2 and len(copies) == 2  # built once a step
    batch.set_rows([-1, -1], torch.device("cpu"))
    assert not batch.has_adapters and batch.groups == [] and batch.by_rows is None and len(copies) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_the_segment_kernels_take_copies_no_row_groups(monkeypatch):
    batch = LoraBatch()
    copies = _count_copies(batch, monkeypatch)
    batch.set_rows([0] * 40 + [-1] * 10 + [1] * 40, torch.device("cuda"))
    assert batch.segments is not None and batch.segments.shape == (4, 3) and copies == []
    assert [slot for slot, _ in batch.groups] == [0, 1] and len(copies) == 2  # the torch fallback's, when asked
