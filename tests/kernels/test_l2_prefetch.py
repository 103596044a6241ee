"""Pulling the next GEMV's weight into L2 (RAYLM_L2_PREFETCH=1, kernels/l2_prefetch.py) changes no result: each
kernel that may prefetch gives the same bits with it and without. GPU only (compute capability 9.0 and later);
when it applies is checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import INTERPRETED, ON_CUDA, import_triton

import_triton()

from raylm.kernels import l2_prefetch  # noqa: E402
from raylm.kernels.l2_prefetch import PREFETCH_MAX_BYTES, PROGRAM_CHUNKS, prefetch_args, prefetch_programs  # noqa: E402

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture(autouse=True)
def fresh_setting():
    l2_prefetch.l2_prefetch_requested.cache_clear()
    l2_prefetch.prefetch_max_bytes.cache_clear()
    yield
    l2_prefetch.l2_prefetch_requested.cache_clear()
    l2_prefetch.prefetch_max_bytes.cache_clear()


def test_the_cap_is_settable_for_tuning(monkeypatch):
    monkeypatch.delenv("RAYLM_L2_PREFETCH_MIB", raising=False)
    assert l2_prefetch.prefetch_max_bytes() == PREFETCH_MAX_BYTES
    monkeypatch.setenv("RAYLM_L2_PREFETCH_MIB", "24")
    l2_prefetch.prefetch_max_bytes.cache_clear()
    assert l2_prefetch.prefetch_max_bytes() == 24 << 20
    for bad in ("0", "-1", "lots", "2048"):
        monkeypatch.setenv("RAYLM_L2_PREFETCH_MIB", bad)
        l2_prefetch.prefetch_max_bytes.cache_clear()
        with pytest.raises(ValueError, match="RAYLM_L2_PREFETCH_MIB"):
            l2_prefetch.prefetch_max_bytes()


def test_prefetch_is_off_unless_asked_for_on_a_gpu(monkeypatch):
    weight = torch.zeros(1024, 1024)
    x = torch.zeros(1, 1024)
    monkeypatch.delenv("RAYLM_L2_PREFETCH", raising=False)
    assert prefetch_args(weight, 1, x)["PREFETCH"] is False
    monkeypatch.setenv("RAYLM_L2_PREFETCH", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    l2_prefetch.l2_prefetch_requested.cache_clear()
    assert l2_prefetch.l2_prefetch_requested()
    off = prefetch_args(weight, 1, x)  # a CPU tensor: nothing to prefetch into
    assert off == {"prefetch_ptr": x, "prefetch_bytes": 0, "PREFETCH": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    l2_prefetch.l2_prefetch_requested.cache_clear()
    assert not l2_prefetch.l2_prefetch_requested()


@pytest.fixture
def prefetching(monkeypatch):
    """run() without the prefetch, then with it."""

    def both(run):
        results = []
        for switch in ("0", "1"):
            monkeypatch.setenv("RAYLM_L2_PREFETCH", switch)
            l2_prefetch.l2_prefetch_requested.cache_clear()
            results.append(run())
            torch.cuda.synchronize()
        return results

    return both


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="bulk L2 prefetch needs compute capability 9.0+")
@pytest.mark.parametrize("mib", [0.03, 5, 200])  # under one chunk (nothing to prefetch), under and over the cap
def test_the_decode_step_kernels_give_the_same_bits_with_the_prefetch(prefetching, mib):
    from raylm.kernels.triton_attention import rotary_decode_attention
    from raylm.kernels.triton_ops import fused_add_rms_norm, rms_norm

    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.empty(int(mib * 2**20) // 2, dtype=torch.bfloat16, device="cuda")
    if mib > 1:
        args = prefetch_args(weight, 1, weight)
        assert args["prefetch_bytes"] == 0  # not asked for yet
    x, residual = (torch.randn(2, 4096, generator=generator, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    norm_weight = torch.randn(4096, generator=generator, device="cuda", dtype=torch.bfloat16)
    heads, kv_heads, dim, page = 8, 2, 128, 16
    q = torch.randn(2, heads, dim, generator=generator, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, dim, generator=generator, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(2, dim, generator=generator, device="cuda") for _ in range(2))
    cache = torch.randn(8, page, kv_heads, dim, generator=generator, device="cuda", dtype=torch.bfloat16)
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([40, 17], dtype=torch.int32, device="cuda")
    slots = torch.tensor([1 * page + 0, 5 * page + 0], device="cuda")  # position 39 is block 3; any free slot

    def run():
        k_cache, v_cache = cache.clone(), cache.clone()
        attended = rotary_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots, tables, lengths, 0.1,
                                           prefetch=weight)
        return (rms_norm(x, norm_weight, 1e-5, prefetch=weight),
                *fused_add_rms_norm(x, residual, norm_weight, 1e-5, prefetch=weight), attended, k_cache, v_cache)

    plain, with_prefetch = prefetching(run)
    assert prefetch_args(weight, 1, weight)["prefetch_bytes"] == (
        min(weight.numel() * 2, PREFETCH_MAX_BYTES) // (64 << 10) * (64 << 10))
    for a, b in zip(plain, with_prefetch):
        assert torch.equal(a, b)


def test_kernels_add_programs_so_that_none_prefetches_more_than_its_chunks():
    chunk = 64 << 10
    assert prefetch_programs({"prefetch_bytes": 0}) == 0
    assert prefetch_programs({"prefetch_bytes": chunk}) == 1
    assert prefetch_programs({"prefetch_bytes": PROGRAM_CHUNKS * chunk + chunk}) == 2
    assert prefetch_programs({"prefetch_bytes": PREFETCH_MAX_BYTES}) == PREFETCH_MAX_BYTES // (PROGRAM_CHUNKS * chunk)


def added_programs(monkeypatch, *modules, chunks: int = 40) -> None:
    """Makes the kernels of `modules` launch the programs of a prefetch of `chunks` chunks without issuing it
    (PREFETCH off: the interpreter has no bulk prefetch), so that the programs past the work run and must
    change nothing."""
    def args(weight, rows, x):
        return {"prefetch_ptr": x, "prefetch_bytes": chunks * (64 << 10), "PREFETCH": False}

    for module in modules:
        monkeypatch.setattr(module, "prefetch_args", args)


@pytest.mark.skipif(not (ON_CUDA or INTERPRETED), reason="Triton kernels need CUDA or RAYLM_TRITON_INTERPRET=1")
@pytest.mark.parametrize("batch", [1, 3])
def test_programs_added_for_a_prefetch_change_nothing(monkeypatch, batch):
    from raylm.kernels import triton_attention, triton_ops

    device = torch.device("cuda" if ON_CUDA else "cpu")
    generator = torch.Generator().manual_seed(batch)
    x, residual = (torch.randn(batch, 96, generator=generator).to(device) for _ in range(2))
    norm_weight = torch.randn(96, generator=generator).to(device)
    heads, kv_heads, dim, page = 4, 2, 32, 16
    q = torch.randn(batch, heads, dim, generator=generator).to(device)
    k, v = (torch.randn(batch, kv_heads, dim, generator=generator).to(device) for _ in range(2))
    cos, sin = (torch.randn(batch, dim, generator=generator).to(device) for _ in range(2))
    cache = torch.randn(3 * batch + 1, page, kv_heads, dim, generator=generator).to(device)
    tables = torch.arange(1, 3 * batch + 1, dtype=torch.int32).view(batch, 3).to(device)
    lengths = torch.tensor([40, 17, 33][:batch], dtype=torch.int32).to(device)
    slots = (tables[:, 0].long() * page).to(device)

    def run():
        k_cache, v_cache = cache.clone(), cache.clone()
        attended = triton_attention.rotary_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots, tables,
                                                            lengths, 0.1, num_splits=2, prefetch=norm_weight)
        return (triton_ops.rms_norm(x, norm_weight, 1e-5, prefetch=norm_weight),
                *triton_ops.fused_add_rms_norm(x, residual, norm_weight, 1e-5, prefetch=norm_weight), attended,
                k_cache, v_cache)

    plain = run()
    added_programs(monkeypatch, triton_ops, triton_attention)
    for a, b in zip(plain, run()):
        assert torch.equal(a, b)
