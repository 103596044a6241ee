"""Programmatic dependent launch (RAYLM_PDL=1, kernels/pdl.py) changes when kernels start, never what they
compute: each kernel gives the same bits with it and without, and a chain of them, in a CUDA graph replayed over
changing inputs behind a slow producer, reads every input only once it is written. GPU only (compute
capability 9.0 and later); the switch itself is checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import import_triton

import_triton()

from raylm.kernels.pdl import pdl_enabled, pdl_options, pdl_requested, pdl_switch  # noqa: E402
from raylm.kernels.triton_attention import paged_decode_attention  # noqa: E402
from raylm.kernels.triton_gemv import gemv  # noqa: E402
from raylm.kernels.triton_kv_cache import rotary_write_kv_cache  # noqa: E402
from raylm.kernels.triton_ops import fused_add_rms_norm, silu_and_mul  # noqa: E402

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture(autouse=True)
def fresh_settings():
    """The switches are read once per process: each test reads them afresh, and leaves them unread."""
    pdl_switch.cache_clear()
    yield
    pdl_switch.cache_clear()


def test_pdl_is_off_unless_asked_for_and_never_on_the_cpu(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("RAYLM_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by the interpreted kernel tests
    assert not pdl_enabled(torch.device("cpu")) and pdl_options(cpu) == {}
    monkeypatch.setenv("RAYLM_PDL", "1")
    pdl_switch.cache_clear()
    assert pdl_requested() and pdl_options(cpu) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pdl_switch.cache_clear()
    assert not pdl_enabled(torch.device("cuda", 0))


def test_pdl_defaults_to_tail_for_weight_streaming_models(monkeypatch):
    """Unset, RAYLM_PDL follows the model runner's default (kernels/dispatch.py); set, it overrides it."""
    from raylm.kernels import dispatch

    monkeypatch.delenv("RAYLM_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        assert pdl_requested() == 0
        dispatch.set_weight_streaming(True)
        assert pdl_requested() == 4  # tail
        monkeypatch.setenv("RAYLM_PDL", "0")
        pdl_switch.cache_clear()
        assert pdl_requested() == 0
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.delenv("RAYLM_PDL")
        pdl_switch.cache_clear()
        assert pdl_requested() == 0  # never interpreted
    finally:
        dispatch.set_weight_streaming(False)


def test_pdl_trigger_modes_are_named_and_checked(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for value, mode in (("0", 0), ("1", 1), ("start", 1), ("after_wait", 2), ("EXIT", 3), ("tail", 4)):
        monkeypatch.setenv("RAYLM_PDL", value)
        pdl_switch.cache_clear()
        assert pdl_requested() == mode
    monkeypatch.setenv("RAYLM_PDL", "sometimes")
    pdl_switch.cache_clear()
    with pytest.raises(ValueError, match="RAYLM_PDL"):
        pdl_requested()


def _both(monkeypatch, run, mode="1"):
    """run() without PDL, then with it (trigger mode `mode`), on one stream."""
    monkeypatch.setenv("RAYLM_PDL", "0")
    pdl_switch.cache_clear()
    plain = run()
    monkeypatch.setenv("RAYLM_PDL", mode)
    pdl_switch.cache_clear()
    return plain, run()


def _assert_same(a, b) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (1000, 72)])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
def test_norm_gemv_and_silu_give_the_same_bits_with_pdl(monkeypatch, rows, n, k):
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    x, residual = torch.randn(rows, k, device=device, dtype=dtype), torch.randn(rows, k, device=device, dtype=dtype)
    weight, norm_weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5, torch.rand(k, device=device,
                                                                                           dtype=dtype)
    _assert_same(*_both(monkeypatch, lambda: gemv(x, weight)))
    _assert_same(*_both(monkeypatch, lambda: fused_add_rms_norm(x, residual, norm_weight, 1e-5)))
    _assert_same(*_both(monkeypatch, lambda: silu_and_mul(torch.cat([x, residual], dim=-1))))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
@pytest.mark.parametrize("rows", [1, 8])
def test_rope_cache_write_and_decode_attention_give_the_same_bits_with_pdl(monkeypatch, rows):
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    heads, kv_heads, head_dim, page = 8, 2, 128, 16
    q, key, value = (torch.randn(rows, h, head_dim, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    cos, sin = torch.rand(rows, head_dim, device=device), torch.rand(rows, head_dim, device=device)
    lengths = torch.tensor([200 + 300 * i for i in range(rows)], dtype=torch.int32, device=device)
    blocks = -(-int(lengths.max()) // page)
    table = torch.arange(1, rows * blocks + 1, dtype=torch.int32, device=device).view(rows, blocks)
    slots = (table[torch.arange(rows), (lengths - 1) // page].long() * page + (lengths - 1) % page)

    def attend():
        caches = [torch.zeros(rows * blocks + 1, page, kv_heads, head_dim, device=device, dtype=dtype)
                  for _ in range(2)]
        torch.manual_seed(1)
        caches[0].normal_(), caches[1].normal_()
        rotated = rotary_write_kv_cache(q, key, value, cos, sin, caches[0], caches[1], slots)
        return rotated, *caches, paged_decode_attention(rotated, caches[0], caches[1], table, lengths, 0.088)

    _assert_same(*_both(monkeypatch, attend))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a CUDA device of capability 9.0+")
@pytest.mark.parametrize("mode", ["start", "after_wait", "exit", "tail"])
def test_a_graphed_chain_reads_inputs_written_just_before_it(monkeypatch, mode):
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

    def chain():
        x = (big @ source)[:1] / 8192**0.5  # the slow producer of the chain's input
        normed, new_residual = fused_add_rms_norm(x, residual, norm_weight, 1e-5)
        return gemv(silu_and_mul(gemv(normed, gate_up)), down) + new_residual

    def replays():
        chain()  # eager first: tunes the GEMV before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        results = []
        for step in range(5):
            torch.manual_seed(100 + step)
            source.normal_()
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize()
        return torch.stack(results)

    plain, pdl = _both(monkeypatch, replays, mode)
    assert torch.equal(plain, pdl)
    assert not torch.equal(plain[0], plain[1])  # the replays saw new inputs
