"""PackedAttention: packed whole sequences attend to their own tokens only, both ways or causally, as one SDPA
call per sequence does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raylm.kernels.packed_attention import PackedAttention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [4, 4]])
def test_each_sequence_attends_to_itself_alone(causal, lengths):
    generator = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(total, heads, dim, generator=generator)
    k = torch.randn(total, kv_heads, dim, generator=generator)
    v = torch.randn(total, kv_heads, dim, generator=generator)
    out = PackedAttention.build(lengths, causal, torch.device("cpu")).attend(q, k, v, None, None, 0.3)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
            is_causal=causal, scale=0.3, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[rows], expected, atol=1e-6, rtol=1e-6)
        start += length


def test_rows_padded_once_at_the_input_give_the_same_attention():
    lengths = [6, 5, 6]
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), 2, 4, generator=generator) for _ in range(3))
    packed = PackedAttention.build(lengths, False, torch.device("cpu"))
    padded = PackedAttention.build(lengths, False, torch.device("cpu"), pad_inputs_below=0.1)
    assert not packed.rows_padded and padded.rows_padded  # one padding row in 18
    expected = packed.attend(q, k, v, None, None, 0.5)
    out = padded.unpad(padded.attend(padded.pad(q), padded.pad(k), padded.pad(v), None, None, 0.5))
    torch.testing.assert_close(out, expected)
