"""The GEMV's shipped tiles (kernels/gemv_tiles.py): the table's file format and lookup, which shipped tilings the
GEMV takes, and a GEMV that launches a shipped tiling instead of tuning."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import INTERPRETED, import_triton

if INTERPRETED:  # before anything imports Triton
    import_triton()

from raylm.kernels import gemv_tiles  # noqa: E402

H200 = "NVIDIA H200"
TABLE = {H200: {"gemv bfloat16 dot x=bfloat16": {"6144x4096": {"BLOCK_K": 256, "BLOCK_N": 64, "num_stages": 4,
                                                               "num_warps": 4}}}}


def test_the_table_reads_back_as_written_and_merges_by_device_variant_and_shape(tmp_path):
    new = {H200: {"gemv bfloat16 dot x=bfloat16": {"6144x4096": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4,
                                                                 "num_stages": 3},
                                                   "4096x14336": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8,
                                                                  "num_stages": 2}}},
           "NVIDIA H100 80GB HBM3": {"gemv_silu_mul bfloat16 dot x=bfloat16": {"14336x4096": {"BLOCK_N": 64}}}}
    merged = gemv_tiles.merged(TABLE, new)
    assert merged[H200]["gemv bfloat16 dot x=bfloat16"]["6144x4096"]["BLOCK_N"] == 32  # replaced
    assert TABLE[H200]["gemv bfloat16 dot x=bfloat16"]["6144x4096"]["BLOCK_N"] == 64  # the input is left alone
    assert set(merged) == {H200, "NVIDIA H100 80GB HBM3"}
    path = tmp_path / "tiles.json"
    path.write_text(gemv_tiles.dumps(merged))
    assert gemv_tiles.load_table(path) == json.loads(path.read_text()) == merged
    lines = path.read_text().splitlines()  # a tiling a line, shapes in order of (N, K)
    assert lines.index('      "4096x14336": {"BLOCK_K": 512, "BLOCK_N": 16, "num_stages": 2, "num_warps": 8},') \
        < lines.index('      "6144x4096": {"BLOCK_K": 128, "BLOCK_N": 32, "num_stages": 3, "num_warps": 4}')


def test_lookup_is_by_gpu_model_variant_and_shape(monkeypatch):
    monkeypatch.setattr(gemv_tiles, "load_table", lambda: TABLE)
    monkeypatch.setattr(gemv_tiles, "device_name", lambda device: H200 if device.index == 0 else "another GPU")
    gpu, other = torch.device("cuda", 0), torch.device("cuda", 1)
    assert gemv_tiles.shipped(gpu, "gemv bfloat16 dot x=bfloat16", 6144, 4096)["BLOCK_N"] == 64
    assert gemv_tiles.shipped(gpu, "gemv bfloat16 dot x=bfloat16", 4096, 6144) is None
    assert gemv_tiles.shipped(gpu, "gemv float16 dot x=float16", 6144, 4096) is None
    assert gemv_tiles.shipped(other, "gemv bfloat16 dot x=bfloat16", 6144, 4096) is None


def test_a_device_other_than_a_gpu_has_no_shipped_tiles(monkeypatch):
    monkeypatch.setattr(gemv_tiles, "load_table", lambda: TABLE)
    assert gemv_tiles.device_name(torch.device("cpu")) == "cpu"
    assert gemv_tiles.shipped(torch.device("cpu"), "gemv bfloat16 dot x=bfloat16", 6144, 4096) is None


def test_the_first_tiling_noted_for_a_key_is_the_one_chosen(monkeypatch):
    monkeypatch.setattr(gemv_tiles, "_chosen", {})
    monkeypatch.setattr(gemv_tiles, "device_name", lambda device: H200)
    import triton

    gpu = torch.device("cuda", 0)

    def config(block_n: int) -> triton.Config:
        return triton.Config({"BLOCK_N": block_n}, num_warps=4, num_stages=3)

    gemv_tiles.note(gpu, "gemv bfloat16 dot x=bfloat16", 6144, 4096, config(64))
    gemv_tiles.note(gpu, "gemv bfloat16 dot x=bfloat16", 6144, 4096, config(16))
    gemv_tiles.note(gpu, "gemv bfloat16 dot x=bfloat16", 4096, 4096, config(32))
    launch = {"num_warps": 4, "num_stages": 3}
    assert gemv_tiles.chosen() == {H200: {"gemv bfloat16 dot x=bfloat16": {"6144x4096": {"BLOCK_N": 64, **launch},
                                                                           "4096x4096": {"BLOCK_N": 32, **launch}}}}


def test_the_shipped_table_names_only_tilings_the_gemv_offers():
    """Every tiling in the shipped file is among its variant's candidates (else the GEMV would ignore it)."""
    pytest.importorskip("triton")
    from raylm.kernels import triton_gemv

    names = {}
    for tuned in (triton_gemv._gemv_tuned, triton_gemv._gemv_silu_mul_tuned):
        kernel = triton_gemv._gemv_kernel if tuned is triton_gemv._gemv_tuned else triton_gemv._gemv_silu_mul_kernel
        for (fp8, mode, core), autotuner in tuned.items():
            for x_dtype in (torch.bfloat16, torch.float16):
                weights = [triton_gemv.FP8_DTYPE] if fp8 else [x_dtype]
                for weight_dtype in weights:
                    name = triton_gemv._variant_name(kernel, weight_dtype, x_dtype, mode, core)
                    names[name] = [gemv_tiles.tiling(config) for config in autotuner.configs]
    for variants in gemv_tiles.load_table().values():
        for variant, shapes in variants.items():
            assert variant in names
            for tiling in shapes.values():
                assert tiling in names[variant], (variant, tiling)


class _Shipping:
    """A table of one tiling for every variant and shape, on whatever device the test runs."""

    def __init__(self, tiling: dict):
        self.tiling = tiling

    def __call__(self, device, variant, N, K):
        return self.tiling


@pytest.fixture
def gemv_module(monkeypatch):
    pytest.importorskip("triton")
    from raylm.kernels import triton_gemv

    triton_gemv._shipped_tiling.cache_clear()
    yield triton_gemv
    triton_gemv._shipped_tiling.cache_clear()


def test_a_shipped_tiling_is_taken_only_where_the_variant_offers_it(gemv_module, monkeypatch):
    offered = gemv_tiles.tiling(gemv_module._gemv_tuned[(False, 0, False)].configs[0])
    split = {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}
    cpu = torch.device("cpu")
    for tiling, N, taken in [(offered, 4096, True), ({**offered, "BLOCK_N": 48}, 4096, False),
                             (split, 4096, True), (split, 2 * gemv_tiles.MAX_SPLIT_N, False)]:
        monkeypatch.setattr(gemv_tiles, "shipped", _Shipping(tiling))
        gemv_module._shipped_tiling.cache_clear()
        got = gemv_module._shipped_tiling(gemv_module._gemv_kernel, torch.bfloat16, torch.bfloat16, 0, False, cpu,
                                          N, 4096)
        assert got == (tiling if taken else None), (tiling, N)


def test_gemv_names_its_variants():
    pytest.importorskip("triton")
    from raylm.kernels import triton_gemv

    fp8 = triton_gemv._variant_name(triton_gemv._gemv_kernel, triton_gemv.FP8_DTYPE, torch.bfloat16, 1, True)
    assert fp8 == "gemv float8_e4m3fn/float16 core x=bfloat16"
    silu = triton_gemv._variant_name(triton_gemv._gemv_silu_mul_kernel, torch.float16, torch.float16, 0, False)
    assert silu == "gemv_silu_mul float16 dot x=float16"
    with pytest.raises(ValueError, match="tiles must be one of"):
        triton_gemv.gemv(torch.zeros(1, 16), torch.zeros(16, 16), tiles="fastest")


def test_one_fp8_row_tunes_the_cuda_and_the_tensor_cores_together(gemv_module):
    """In the fp8 input mode one row's tilings are those of the CUDA cores and those of the FP8 tensor cores (x
    padded to 16 rows), each naming its rows a tile; the other one-row variants keep the CUDA cores' alone."""
    tilings = [gemv_tiles.tiling(config) for config in gemv_module._gemv_tuned[(True, 2, True)].configs]
    assert {(tiling["CORE"], tiling["BLOCK_M"]) for tiling in tilings} == {(1, 1), (0, 16)}
    assert any(tiling.get("SWAP_AB") and not tiling["CORE"] for tiling in tilings)
    for mode in (0, 1):
        others = [gemv_tiles.tiling(config) for config in gemv_module._gemv_tuned[(True, mode, True)].configs]
        assert all(tiling["CORE"] == 1 and "BLOCK_M" not in tiling for tiling in others)


@pytest.mark.slow
def test_a_gemv_with_shipped_tiles_launches_them_without_tuning(gemv_module, monkeypatch):
    """Interpreted on the CPU (RAYLM_TRITON_INTERPRET=1) or on a GPU: the shipped tiling (a split of K, which the
    interpreter's own default never takes) is what launches, and gives F.linear's result."""
    from tests.kernels import kernel_device

    device = kernel_device()
    tiling = {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3}
    monkeypatch.setattr(gemv_tiles, "shipped", _Shipping(tiling))
    launches = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                launches.append((grid, {key: kwargs.get(key) for key in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}))
                return launch(*args, **kwargs)
            return run

    monkeypatch.setattr(gemv_module, "_gemv_kernel", Recording(gemv_module._gemv_kernel))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=generator).to(device, torch.float16)
    weight = (torch.randn(64, 256, generator=generator) / 16).to(device, torch.float16)
    got = gemv_module.gemv(x, weight, tiles="shipped")
    torch.testing.assert_close(got, F.linear(x.float(), weight.float()).half(), atol=2e-3, rtol=2e-3)
    assert launches == [((4, 2), {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 2})]


class _Warming:
    """A kernel as compile_in_threads calls it: records each warm-up's configuration and thread; one fails."""

    def __init__(self, failing: int):
        self.failing = failing
        self.calls: list[tuple[int, bool, int, tuple]] = []

    def run(self, *args, grid, warmup, **kwargs):
        import threading

        self.calls.append((kwargs["BLOCK_N"], warmup, threading.get_ident(), args))
        if kwargs["BLOCK_N"] == self.failing:
            raise RuntimeError("out of resources")


def test_compile_in_threads_warms_up_every_configuration_and_leaves_failures_to_the_tuning(monkeypatch):
    import threading

    triton = pytest.importorskip("triton")
    devices = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    configs = [triton.Config({"BLOCK_N": block_n}, num_warps=4) for block_n in (16, 32, 64, 128)]
    kernel = _Warming(failing=64)
    gemv_tiles.compile_in_threads(kernel, configs, ("x", "w"), {"grid": (1,), "warmup": False, "HAS_BIAS": False})
    assert sorted(block_n for block_n, *_ in kernel.calls) == [16, 32, 64, 128]
    assert all(warmup and args == ("x", "w") for _, warmup, _, args in kernel.calls)  # compiled, never launched
    first = next(call for call in kernel.calls if call[0] == 16)
    assert first[2] == threading.get_ident()  # the first sets up the kernel's caches in the caller's thread
    assert devices == [3] * 4  # each on the caller's device
    kernel.calls.clear()
    gemv_tiles.compile_in_threads(kernel, configs[:1], (), {"grid": (1,), "warmup": False})
    assert kernel.calls == []  # one configuration is not timed: nothing to compile ahead
    failing_first = _Warming(failing=16)
    gemv_tiles.compile_in_threads(failing_first, configs, (), {"grid": (1,), "warmup": False})
    assert [block_n for block_n, *_ in failing_first.calls] == [16]  # no threads after the first one failed


def test_the_autotuner_compiles_ahead_only_where_it_times(monkeypatch):
    triton = pytest.importorskip("triton")

    @triton.jit
    def kernel(x_ptr, N, K, BLOCK_N: triton.language.constexpr):
        pass

    configs = [triton.Config({"BLOCK_N": block_n}) for block_n in (16, 32)]
    tuner = gemv_tiles.autotune(kernel, configs)
    events = []
    monkeypatch.setattr(gemv_tiles, "compile_in_threads",
                        lambda fn, tried, args, kwargs: events.append(("compile", fn, len(tried), args, kwargs)))

    def cached(hit):
        def check_disk_cache(self, tuning_key, tried, bench_fn):
            if not hit:
                bench_fn()
            return hit
        return check_disk_cache

    for hit in (False, True):
        events.clear()
        monkeypatch.setattr(triton.runtime.Autotuner, "check_disk_cache", cached(hit))
        tuner._call = (("x",), {"grid": (1,)})
        assert tuner.check_disk_cache((4096, 4096), configs, lambda: events.append("time")) is hit
        expected = [] if hit else [("compile", kernel, 2, ("x",), {"grid": (1,)}), "time"]
        assert events == expected
    calls = []
    monkeypatch.setattr(triton.runtime.Autotuner, "run", lambda self, *args, **kwargs: calls.append(self._call))
    tuner.run("x", 4096, 4096, grid=(1,), warmup=False)
    assert calls == [(("x", 4096, 4096), {"grid": (1,), "warmup": False})] and tuner._call is None
