"""pool(): mean, CLS and last-token pooling of packed hidden states, normalized or not."""

from __future__ import annotations

import pytest
import torch

from raylm.engine.pooling_runner import pool
from raylm.pooling import PoolingSpec

LENGTHS = [3, 1, 4]


@pytest.fixture
def hidden() -> torch.Tensor:
    return torch.randn(sum(LENGTHS), 6, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("pooling_type", "pick"), [
    ("mean", lambda rows: rows.mean(0)), ("cls", lambda rows: rows[0]), ("last", lambda rows: rows[-1])])
@pytest.mark.parametrize("normalize", [False, True])
def test_each_sequence_pools_its_own_rows(hidden, pooling_type, pick, normalize):
    pooled = pool(hidden, LENGTHS, PoolingSpec(pooling_type, normalize, 6))
    expected = torch.stack([pick(rows) for rows in hidden.split(LENGTHS)])
    if normalize:
        expected = expected / expected.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(pooled.norm(dim=-1), torch.ones(len(LENGTHS)))
    torch.testing.assert_close(pooled, expected)
