"""Programmatic dependent launch (kernel_config.pdl, kernels/pdl.py) changes when kernels start, never what they
compute: each kernel gives the same bits with it and without, and a chain of them, in a CUDA graph replayed over
changing inputs behind a slow producer, reads every input only once it is written. GPU only (compute
capability 9.0 and later); the launch options are checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import import_triton

import_triton()

from raylm.kernels.pdl import launch_options  # noqa: E402
from raylm.kernels.policy import PDL_TRIGGERS  # noqa: E402
from raylm.kernels.triton_attention import paged_decode_attention  # noqa: E402
from raylm.kernels.triton_gemv import gemv  # noqa: E402
from raylm.kernels.triton_kv_cache import rotary_write_kv_cache  # noqa: E402
from raylm.kernels.triton_lora import add_lora_rows  # noqa: E402
from raylm.kernels.triton_ops import fused_add_rms_norm, silu_and_mul  # noqa: E402

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_a_launch_asks_for_pdl_only_with_a_trigger_mode():
    assert launch_options(0) == {}
    for name, mode in PDL_TRIGGERS.items():
        assert launch_options(mode) == ({"USE_PDL": mode, "launch_pdl": True} if name != "off" else {})


def _both(run, mode: str = "start"):
    """run(pdl) without PDL, then with it (trigger mode `mode`), on one stream."""
    return run(0), run(PDL_TRIGGERS[mode])


def _assert_same(a, b) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (1000, 72)])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
def test_norm_gemv_and_silu_give_the_same_bits_with_pdl(rows, n, k):
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    x, residual = torch.randn(rows, k, device=device, dtype=dtype), torch.randn(rows, k, device=device, dtype=dtype)
    weight, norm_weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5, torch.rand(k, device=device,
                                                                                           dtype=dtype)
    _assert_same(*_both(lambda pdl: gemv(x, weight, pdl=pdl)))
    _assert_same(*_both(lambda pdl: fused_add_rms_norm(x, residual, norm_weight, 1e-5, pdl)))
    _assert_same(*_both(lambda pdl: silu_and_mul(torch.cat([x, residual], dim=-1), pdl)))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
@pytest.mark.parametrize("rows", [1, 8])
def test_rope_cache_write_and_decode_attention_give_the_same_bits_with_pdl(rows):
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, head_dim, page = 8, 2, 128, 16
    q, key, value = (torch.randn(rows, h, head_dim, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    cos, sin = torch.rand(rows, head_dim, device=device), torch.rand(rows, head_dim, device=device)
    lengths = torch.tensor([200 + 300 * i for i in range(rows)], dtype=torch.int32, device=device)
    blocks = -(-int(lengths.max()) // page)
    table = torch.arange(1, rows * blocks + 1, dtype=torch.int32, device=device).view(rows, blocks)
    slots = (table[torch.arange(rows), (lengths - 1) // page].long() * page + (lengths - 1) % page)

    def attend(pdl: int):
        caches = [torch.zeros(rows * blocks + 1, page, kv_heads, head_dim, device=device, dtype=dtype)
                  for _ in range(2)]
        torch.manual_seed(1)
        caches[0].normal_(), caches[1].normal_()
        rotated = rotary_write_kv_cache(q, key, value, cos, sin, caches[0], caches[1], slots, pdl)
        return rotated, *caches, paged_decode_attention(rotated, caches[0], caches[1], table, lengths, 0.088,
                                                        pdl=pdl)

    _assert_same(*_both(attend))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
@pytest.mark.parametrize("mode", ["start", "after_wait", "exit", "tail"])
def test_a_graphed_chain_reads_inputs_written_just_before_it(mode):
    """norm -> GEMV -> SiLU-mul -> GEMV launched with PDL in one CUDA graph, after a long matmul that writes the
    chain's input in the same graph: every replay, with new data, must equal the chain without PDL."""
    torch.manual_seed(2)
    device, dtype, hidden, inner = torch.device("cuda"), torch.bfloat16, 4096, 14336
    big = torch.randn(8192, 8192, device=device, dtype=dtype)  # ~1 ms of matmul ahead of the chain
    source = torch.randn(8192, hidden, device=device, dtype=dtype)
    residual = torch.randn(1, hidden, device=device, dtype=dtype)
    norm_weight = torch.rand(hidden, device=device, dtype=dtype)
    gate_up = torch.randn(2 * inner, hidden, device=device, dtype=dtype) / hidden**0.5
    down = torch.randn(hidden, inner, device=device, dtype=dtype) / inner**0.5

    def chain(pdl: int):
        x = (big @ source)[:1] / 8192**0.5  # the slow producer of the chain's input
        normed, new_residual = fused_add_rms_norm(x, residual, norm_weight, 1e-5, pdl)
        return gemv(silu_and_mul(gemv(normed, gate_up, pdl=pdl), pdl), down, pdl=pdl) + new_residual

    def replays(pdl: int):
        chain(pdl)  # eager first: tunes the GEMV before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(pdl)
        results = []
        for step in range(5):
            torch.manual_seed(100 + step)
            source.normal_()
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize()
        return torch.stack(results)

    plain, pdl = _both(replays, mode)
    assert torch.equal(plain, pdl)
    assert not torch.equal(plain[0], plain[1])  # the replays saw new inputs


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
@pytest.mark.parametrize("mode", ["start", "tail"])
def test_lora_kernels_after_a_gemv_give_the_same_bits_with_pdl(mode):
    """The adapters' shrink and expand behind the fused qkv GEMV they add to, rows of three adapters and none."""
    torch.manual_seed(3)
    device, dtype, hidden, rank = torch.device("cuda"), torch.bfloat16, 4096, 16
    sizes = [4096, 1024, 1024]
    x = torch.randn(8, hidden, device=device, dtype=dtype)
    weight = torch.randn(sum(sizes), hidden, device=device, dtype=dtype) / hidden**0.5
    lora_a = torch.randn(3, 3 * rank, hidden, device=device, dtype=dtype) / hidden**0.5
    lora_b = torch.randn(3, sum(sizes), rank, device=device, dtype=dtype) / rank
    slots = torch.tensor([0, 1, 2, -1, 0, 2, -1, 1], dtype=torch.int32, device=device)

    def run(pdl: int):
        return add_lora_rows(gemv(x, weight, pdl=pdl), x, lora_a, lora_b, sizes, slots, pdl)

    _assert_same(*_both(run, mode))
