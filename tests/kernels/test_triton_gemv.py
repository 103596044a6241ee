"""The decode GEMV kernel (kernels/triton_gemv.py) against F.linear, and the layers' dispatch to it."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels import triton_gemv  # noqa: E402
from raylm.kernels.fp8 import FP8_DTYPE, Fp8Rows, dequantize_fp8, fp8_linear, quantize_fp8  # noqa: E402
from raylm.kernels.linear import linear  # noqa: E402
from raylm.kernels.policy import KernelPolicy  # noqa: E402
from raylm.kernels.triton_gemv import GEMV_MAX_ROWS, gemv, gemv_silu_mul  # noqa: E402
from raylm.kernels.triton_ops import silu_and_mul  # noqa: E402

pytestmark = MODULE_MARKS

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16")]
# Both sum K products in float32 and round once, in different orders: about one unit in the last place.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_FP8_TILES = {"BLOCK_N": 16, "BLOCK_K": 256}  # for FP8 tests whose subject is not the tuning


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (100, 300), (48, 1030)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gemv_matches_linear(dtype, rows, n, k, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    expected = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None).to(dtype)
    got = gemv(x, weight, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(100, 300), (48, 1030)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_split_k_gemv_matches_linear_and_resets_its_counters(dtype, split_k, rows, n, k, with_bias):
    """Split K (K = 300 in 128-wide tiles over 4 splits leaves the last split empty): the partials' sum against
    F.linear, the same bits on a second call, and every arrival counter back at zero."""
    generator = torch.Generator().manual_seed(split_k * 100 + rows + n)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    config = {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": split_k}
    expected = F.linear(x.float(), weight.float(), bias.float() if bias is not None else None).to(dtype)
    got = gemv(x, weight, bias, config=config)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(gemv(x, weight, bias, config=config), got)
    _, arrivals = triton_gemv._split_workspace(x.device, n)
    assert not arrivals.any()


def test_split_k_is_refused_where_it_has_no_workspace():
    x, weight = torch.randn(1, 64).to(DEVICE, torch.float16), torch.randn(32, 64).to(DEVICE, torch.float16)
    with pytest.raises(ValueError, match="SPLIT_K=8"):
        gemv(x, weight, config={"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 8})
    with pytest.raises(ValueError, match="SPLIT_K=2"):
        gemv_silu_mul(x, weight, config={"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2})


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_split_k_gemv_in_a_cuda_graph_gives_the_same_bits_every_replay():
    """The arrival counters reset inside the graph: every replay, on new input, equals the eager call; the
    tuned GEMV (which may pick a split) matches F.linear on the o-projection shape."""
    torch.manual_seed(3)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    config = {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4}
    gemv(x, weight, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, weight, config=config)
    for _ in range(4):
        x.normal_()
        graph.replay()
        assert torch.equal(out, gemv(x, weight, config=config))
    torch.testing.assert_close(gemv(x, weight), F.linear(x, weight), atol=1.6e-2, rtol=1.6e-2)


def test_gemv_keeps_leading_dimensions_and_refuses_what_it_cannot_do():
    x = torch.randn(2, 1, 64).to(DEVICE, torch.float16)
    weight = torch.randn(32, 64).to(DEVICE, torch.float16)
    assert gemv(x, weight).shape == (2, 1, 32)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 64).to(DEVICE, torch.float16), weight)
    with pytest.raises(TypeError, match="float16, bfloat16 or float8_e4m3fn"):
        gemv(x.float(), weight.float())
    with pytest.raises(ValueError, match="does not fit"):
        gemv(torch.randn(1, 63).to(DEVICE, torch.float16), weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (100, 300)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gemv_silu_mul_matches_gemv_then_silu_and_mul(dtype, rows, n, k, with_bias):
    """The SiLU-mul epilogue rounds as the two kernels do: each projection, then the activation, then the
    product. The two GEMVs' sums may run in different tile orders: about one unit in the last place."""
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(2 * n, k, generator=generator) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(2 * n, generator=generator).to(DEVICE, dtype) if with_bias else None
    expected = silu_and_mul(gemv(x, weight, bias))
    got = gemv_silu_mul(x, weight, bias)
    assert got.shape == (rows, n) and got.dtype == dtype
    tolerance = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_gemv_silu_mul_refuses_an_odd_merged_weight():
    with pytest.raises(ValueError, match="gate and up rows"):
        gemv_silu_mul(torch.randn(1, 64).to(DEVICE, torch.float16), torch.randn(33, 64).to(DEVICE, torch.float16))


# ------------------------------------------------------------------ FP8 weights


def _fp8_case(rows: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int):
    """x, an FP8 weight with its per-row scales (rows of very different magnitudes), and a bias or None."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    weight[::7] *= 30.0
    quantized, scale = (tensor.to(DEVICE) for tensor in quantize_fp8(weight))
    bias = torch.randn(n, generator=generator).to(DEVICE, dtype) if with_bias else None
    return x, quantized, scale, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(64, 256), (100, 600)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_gemv_is_linear_of_the_dequantized_weight(dtype, rows, n, k, with_bias, split_k):
    """An FP8 weight widened in the kernel, x as it is, the row's scale on the float32 sum: F.linear of x and the
    dequantized weight, to about one unit in the last place; split K sums the scaled partials the same way."""
    x, quantized, scale, bias = _fp8_case(rows, n, k, dtype, with_bias, seed=rows * 100 + n + split_k)
    expected = F.linear(x.float(), dequantize_fp8(quantized, scale), None if bias is None else bias.float())
    config = {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split_k}
    got = gemv(x, quantized, bias, weight_scale=scale, config=config)
    assert got.shape == (rows, n) and got.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected.to(dtype), atol=tolerance * expected.abs().max().item(), rtol=tolerance)


def _fp8_gemv_with_and_without(flag: str, rows: int, dtype, input_mode: str, with_bias: bool, config: dict,
                               seed: int):
    """An FP8 case of `rows` rows (x made exactly quantizable for the fp8 input mode) and its GEMV under `config`
    without and with the tiling flag `flag`: (x, quantized, scale, bias, plain, flagged)."""
    x, quantized, scale, bias = _fp8_case(rows, 100, 600, dtype, with_bias, seed=seed)
    if input_mode == "fp8":
        x = _fp8_exact_rows(rows, 600, dtype, seed=seed)
    plain = gemv(x, quantized, bias, weight_scale=scale, input_mode=input_mode, config=config)
    flagged = gemv(x, quantized, bias, weight_scale=scale, input_mode=input_mode, config={**config, flag: 1})
    return x, quantized, scale, bias, plain, flagged


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("input_mode", ["model_dtype", "float16", "fp8"])
@pytest.mark.parametrize("split_k", [1, 2])
def test_the_weight_first_dot_sums_as_the_transposed_one_does(dtype, input_mode, split_k):
    """SWAP_AB (an FP8 tiling the tuner may pick): the dot takes the weight tile first and x transposed, and the
    sums are transposed back once after the loop: the same output, through the split-K and SiLU-mul kernels too."""
    x, quantized, scale, _, plain, swapped = _fp8_gemv_with_and_without(
        "SWAP_AB", 3, dtype, input_mode, True, {"BLOCK_N": 32, "BLOCK_K": 256, "SPLIT_K": split_k}, seed=21 + split_k)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(swapped, plain, atol=tolerance * plain.abs().max().item(), rtol=tolerance)
    if split_k == 1:
        tiles = {"BLOCK_N": 16, "BLOCK_K": 256}
        plain = gemv_silu_mul(x, quantized[:96], weight_scale=scale[:96], input_mode=input_mode, config=tiles)
        swapped = gemv_silu_mul(x, quantized[:96], weight_scale=scale[:96], input_mode=input_mode,
                                config={**tiles, "SWAP_AB": 1})
        torch.testing.assert_close(swapped, plain, atol=2 * tolerance, rtol=2 * tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tuned_fp8_gemv_is_linear_of_the_dequantized_weight(dtype):
    """The tile shapes tuned for FP8 weights (wider K tiles), on a shape that times all of them once."""
    x, quantized, scale, _ = _fp8_case(2, 96, 1024, dtype, False, seed=5)
    expected = F.linear(x.float(), dequantize_fp8(quantized, scale)).to(dtype)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(gemv(x, quantized, weight_scale=scale), expected,
                               atol=tolerance * expected.abs().max().item(), rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_the_tuning_compiles_every_tiling_in_threads_before_it_times_one(monkeypatch, tmp_path):
    """gemv_tiles.autotune: with nothing compiled or tuned (an empty Triton cache, the kernel's compiled tilings set
    aside), every tiling of a shape compiles before the first one is timed, in more than one thread, and the
    tiling chosen gives F.linear's result."""
    import collections
    import os
    import threading

    import triton

    kernel = triton_gemv._gemv_kernel
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(kernel, "device_caches", collections.defaultdict(kernel.create_binder))
    events = []
    compile_kernel, time_config = type(kernel)._do_compile, triton.runtime.Autotuner._bench

    def compiling(self, *args, **kwargs):
        if self is kernel:
            events.append(("compile", threading.get_ident()))
        return compile_kernel(self, *args, **kwargs)

    def timing(self, *args, **kwargs):
        events.append(("time", None))
        return time_config(self, *args, **kwargs)

    monkeypatch.setattr(type(kernel), "_do_compile", compiling)
    monkeypatch.setattr(triton.runtime.Autotuner, "_bench", timing)
    x, quantized, scale, _ = _fp8_case(GEMV_MAX_ROWS, 112, 1024, torch.bfloat16, False, seed=13)
    got = gemv(x, quantized, weight_scale=scale, input_mode="float16", tiles="tune")
    expected = F.linear(x.float(), dequantize_fp8(quantized, scale)).to(x.dtype)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[x.dtype] * expected.abs().max().item(),
                               rtol=TOLERANCE[x.dtype])
    first_timing = events.index(("time", None))
    compiled = {thread for event, thread in events[:first_timing] if event == "compile"}
    assert first_timing == len(triton_gemv._gemv_tuned[(True, 1, False)].configs)  # all of them, none pruned
    assert all(event == "time" for event, _ in events[first_timing:])
    assert len(compiled) > 1 or len(os.sched_getaffinity(0)) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_fp8_gemv_silu_mul_scales_gate_and_up_rows_by_their_own_scales(dtype, with_bias):
    x, quantized, scale, bias = _fp8_case(3, 2 * 48, 256, dtype, with_bias, seed=11)
    # Fixed tiles: tuning (about 20 s a shape on the H200) is test_tuned_fp8_gemv's subject.
    expected = silu_and_mul(gemv(x, quantized, bias, weight_scale=scale, config=_FP8_TILES))
    got = gemv_silu_mul(x, quantized, bias, weight_scale=scale, config=_FP8_TILES)
    assert got.shape == (3, 48) and got.dtype == dtype
    tolerance = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_fp8_gemv_refuses_a_missing_or_misshapen_scale_by_name():
    x, quantized, scale, _ = _fp8_case(1, 32, 64, torch.float16, False, seed=0)
    with pytest.raises(ValueError, match="weight_scale goes with a float8_e4m3fn weight"):
        gemv(x, quantized)
    with pytest.raises(ValueError, match="weight_scale goes with a float8_e4m3fn weight"):
        gemv(x, quantized.to(torch.float16), weight_scale=scale)
    with pytest.raises(ValueError, match=r"weight_scale must be contiguous float32 of shape \[32\]"):
        gemv(x, quantized, weight_scale=scale[:16])
    with pytest.raises(ValueError, match="weight_scale must be"):
        gemv(x, quantized, weight_scale=scale.half())
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x.float(), quantized, weight_scale=scale)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_linear_sends_fp8_decode_rows_to_the_gemv_and_larger_inputs_to_the_fp8_matmul(monkeypatch):
    """Under a policy with the decode GEMV, an FP8 layer's few rows take the GEMV (x not quantized), more rows
    the FP8 matmul (x quantized per token)."""
    policy = KernelPolicy(triton=True, decode_gemv=True)
    weight = torch.randn(4096, 1024) / 32
    quantized, scale = (tensor.cuda() for tensor in quantize_fp8(weight))
    assert quantized.dtype == FP8_DTYPE
    few = torch.randn(GEMV_MAX_ROWS, 1024, device="cuda", dtype=torch.bfloat16)
    many = torch.randn(GEMV_MAX_ROWS + 1, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(few, quantized, None, policy, scale), gemv(few, quantized, weight_scale=scale))
    assert torch.equal(linear(many, quantized, None, policy, scale), fp8_linear(many, quantized, scale))
    without_gemv = KernelPolicy(triton=True)
    assert torch.equal(linear(few, quantized, None, without_gemv, scale), fp8_linear(few, quantized, scale))


def _fp8_exact_rows(rows: int, k: int, dtype: torch.dtype, seed: int, block: int | None = None) -> torch.Tensor:
    """Input rows that quantize without rounding: FP8 values (each row's largest 448; with `block`, each block of
    that many values' largest) times a power of two. Triton's interpreter rounds float32 to float8e4nv wrongly where
    rounding up crosses a power of two (127.9 becomes 64), so the interpreter gets inputs that need no rounding; the
    GPU takes any input as well."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, k, generator=generator).mul(40.0).clamp(-448, 448).to(FP8_DTYPE).float()
    if block is None:
        values[:, 3] = 448.0
    else:
        values[:, 5::block] = -448.0
    return (values * 2.0 ** torch.arange(-8, -8 + rows)[:, None]).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("inputs", ["exact", pytest.param("random", marks=GPU_ONLY)])
def test_fp8_input_gemv_is_the_fp8_matmul_s_reference(dtype, rows, split_k, with_bias, inputs):
    """quantize_input: the input rows quantized per token over the whole of K (each split finds the same scale),
    FP8 multiplied by FP8: fp8_linear_reference's result, to about one unit in the last place."""
    from raylm.kernels.fp8 import fp8_linear_reference

    x, quantized, scale, bias = _fp8_case(rows, 100, 600, dtype, with_bias, seed=rows + split_k)
    if inputs == "exact":
        x = _fp8_exact_rows(rows, 600, dtype, seed=rows)
    else:
        x[0, 7] = 40.0  # an outlier: its row's scale
    expected = fp8_linear_reference(x.float(), quantized, scale, None if bias is None else bias.float())
    config = {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split_k}
    got = gemv(x, quantized, bias, weight_scale=scale, input_mode="fp8", config=config)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected.to(dtype), atol=tolerance * expected.abs().max().item(), rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("input_mode", "k", "tiles", "seed"), [
    ("fp8", 256, _FP8_TILES, 13), ("fp8_tiles", 384, {"BLOCK_N": 16, "BLOCK_K": 128}, 17)], ids=["fp8", "fp8_tiles"])
def test_fp8_input_gemv_silu_mul_is_gemv_then_silu_and_mul(dtype, input_mode, k, tiles, seed):
    _, quantized, scale, _ = _fp8_case(3, 2 * 48, k, dtype, False, seed=seed)
    x = _fp8_exact_rows(3, k, dtype, seed=seed, block=128 if input_mode == "fp8_tiles" else None)
    expected = silu_and_mul(gemv(x, quantized, weight_scale=scale, input_mode=input_mode, config=tiles))
    got = gemv_silu_mul(x, quantized, weight_scale=scale, input_mode=input_mode, config=tiles)
    tolerance = 2 * TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("config", [{"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2},
                                    {"BLOCK_N": 32, "BLOCK_K": 256, "SWAP_AB": 1}], ids=["split", "weight-first"])
def test_fp8_rows_quantized_before_give_the_fp8_input_mode_s_bits(rows, config):
    """FP8 rows handed over by the kernel before (Fp8Rows, as the RMSNorm writes them) go into the GEMV as they are:
    the bits of the "fp8" input mode quantizing the same rows itself, in the plain and the SiLU-mul GEMV."""
    dtype = torch.float16
    _, quantized, scale, bias = _fp8_case(rows, 2 * 48, 512, dtype, True, seed=rows)
    x = _fp8_exact_rows(rows, 512, dtype, seed=rows)
    handed = Fp8Rows(*quantize_fp8(x), dtype)
    got = gemv(handed, quantized, bias, weight_scale=scale, input_mode="fp8", config=config)
    assert got.dtype == dtype and got.shape == (rows, 2 * 48)
    assert torch.equal(got, gemv(x, quantized, bias, weight_scale=scale, input_mode="fp8", config=config))
    if rows == 1:  # on the CUDA cores
        core = {"BLOCK_N": 16, "BLOCK_K": 256, "CORE": 1}
        assert torch.equal(gemv(handed, quantized, bias, weight_scale=scale, input_mode="fp8", config=core),
                           gemv(x, quantized, bias, weight_scale=scale, input_mode="fp8", config=core))
    tiles = {key: value for key, value in config.items() if key != "SPLIT_K"}
    assert torch.equal(gemv_silu_mul(handed, quantized, weight_scale=scale, input_mode="fp8", config=tiles),
                       gemv_silu_mul(x, quantized, weight_scale=scale, input_mode="fp8", config=tiles))


def test_fp8_rows_need_the_fp8_input_mode_and_their_own_shapes():
    _, quantized, scale, _ = _fp8_case(2, 32, 64, torch.float16, False, seed=1)
    values, row_scale = quantize_fp8(_fp8_exact_rows(2, 64, torch.float16, seed=1))
    with pytest.raises(ValueError, match="takes FP8 rows .* in input_mode 'fp8' only, got 'float16'"):
        gemv(Fp8Rows(values, row_scale, torch.float16), quantized, weight_scale=scale, input_mode="float16")
    with pytest.raises(ValueError, match=r"need float8_e4m3fn values \[M, 64\] and contiguous float32 scales"):
        gemv(Fp8Rows(values, row_scale[:1], torch.float16), quantized, weight_scale=scale, input_mode="fp8")
    with pytest.raises(ValueError, match="stand for float16 or bfloat16 rows"):
        gemv(Fp8Rows(values, row_scale, torch.float32), quantized, weight_scale=scale, input_mode="fp8")


def test_an_input_mode_needs_an_fp8_weight_and_a_name_gemv_knows():
    x = torch.randn(1, 64).to(DEVICE, torch.float16)
    with pytest.raises(ValueError, match="input_mode 'fp8' goes with a float8_e4m3fn weight"):
        gemv(x, torch.randn(32, 64).to(DEVICE, torch.float16), input_mode="fp8")
    _, quantized, scale, _ = _fp8_case(1, 32, 64, torch.float16, False, seed=0)
    with pytest.raises(ValueError, match=r"input_mode must be one of \['float16', 'fp8', 'fp8_tiles', 'model_dtype'\]"):
        gemv(x, quantized, weight_scale=scale, input_mode="fp4")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_float16_input_gemv_is_linear_of_the_dequantized_weight(dtype, split_k):
    """input_mode 'float16': the weight widened to float16 and the input rounded to it (exact for these values)."""
    x, quantized, scale, bias = _fp8_case(GEMV_MAX_ROWS, 100, 600, dtype, True, seed=split_k)
    expected = F.linear(x.float(), dequantize_fp8(quantized, scale), bias.float())
    got = gemv(x, quantized, bias, weight_scale=scale, input_mode="float16",
               config={"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split_k})
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected.to(dtype), atol=tolerance * expected.abs().max().item(), rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("input_mode", ["model_dtype", "float16", "fp8"])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_one_row_on_the_cuda_cores_sums_as_the_dot_does(dtype, input_mode, split_k, with_bias):
    """CORE (what a one-row GEMV on FP8 weights runs): x's row times the widened weight element by element in
    float32, summed over K after the loop, each tile's successor loaded before the tile is used: the dot's output and
    F.linear of the dequantized weight, through split K and a K that is no multiple of the tile."""
    x, quantized, scale, bias, dot, core = _fp8_gemv_with_and_without(
        "CORE", 1, dtype, input_mode, with_bias, {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split_k},
        seed=31 + split_k)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(core, dot, atol=tolerance * dot.abs().max().item(), rtol=tolerance)
    if input_mode == "model_dtype":
        expected = F.linear(x.float(), dequantize_fp8(quantized, scale), None if bias is None else bias.float())
        torch.testing.assert_close(core, expected.to(dtype), atol=tolerance * expected.abs().max().item(),
                                   rtol=tolerance)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("k", [200, 256, 700, 1100], ids=str)
def test_one_row_loading_two_tiles_ahead_sums_as_one_tile_ahead(split_k, k):
    """CORE_AHEAD 2 requests each tile's two successors before multiplying it: the same products summed in the same
    order as CORE_AHEAD 1, bit for bit, whether K holds one tile, two, or more, whole or not, split or not."""
    x, quantized, scale, _ = _fp8_case(1, 48, k, torch.float16, False, seed=k + split_k)
    tiles = {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split_k, "CORE": 1}
    one = gemv(x, quantized, weight_scale=scale, input_mode="float16", config={**tiles, "CORE_AHEAD": 1})
    two = gemv(x, quantized, weight_scale=scale, input_mode="float16", config={**tiles, "CORE_AHEAD": 2})
    assert torch.equal(one, two)


def test_the_cuda_cores_take_one_row_of_the_plain_gemv_only():
    x, quantized, scale, _ = _fp8_case(2, 32, 256, torch.float16, False, seed=0)
    core = {"BLOCK_N": 16, "BLOCK_K": 256, "CORE": 1}
    with pytest.raises(ValueError, match="CORE multiplies at most 1 input row, in the plain GEMV; got M=2"):
        gemv(x, quantized, weight_scale=scale, config=core)
    with pytest.raises(ValueError, match="in the plain GEMV; got M=1"):
        gemv_silu_mul(x[:1], quantized, weight_scale=scale, config=core)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("input_mode", ["model_dtype", "float16"])
def test_tuned_one_row_fp8_gemvs_are_linear_of_the_dequantized_weight(input_mode):
    """One row on FP8 weights takes the CUDA-core tilings in the plain GEMV by default (split K among them): F.linear
    of the dequantized weight; the SiLU-mul GEMV of that row (on the dot) agrees with it."""
    x, quantized, scale, bias = _fp8_case(1, 2 * 1536, 2048, torch.bfloat16, True, seed=41)
    expected = F.linear(x.float(), dequantize_fp8(quantized, scale), bias.float())
    tolerance = TOLERANCE[torch.bfloat16]
    got = gemv(x, quantized, bias, weight_scale=scale, input_mode=input_mode)
    torch.testing.assert_close(got, expected.to(x.dtype), atol=tolerance * expected.abs().max().item(),
                               rtol=tolerance)
    activated = gemv_silu_mul(x, quantized, bias, weight_scale=scale, input_mode=input_mode)
    torch.testing.assert_close(activated, silu_and_mul(got), atol=2 * tolerance, rtol=2 * tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_one_fp8_row_tuned_across_the_cuda_and_the_tensor_cores_is_the_fp8_matmul_s_reference():
    """In the fp8 input mode one row tunes the CUDA-core and the FP8 tensor-core tilings together: whichever wins,
    fp8_linear_reference's result, from the bfloat16 row or from its FP8 rows handed over."""
    from raylm.kernels.fp8 import fp8_linear_reference

    x, quantized, scale, bias = _fp8_case(1, 2 * 1536, 2048, torch.bfloat16, True, seed=43)
    expected = fp8_linear_reference(x.float(), quantized, scale, bias.float()).to(x.dtype)
    tolerance = TOLERANCE[torch.bfloat16]
    got = gemv(x, quantized, bias, weight_scale=scale, input_mode="fp8")
    torch.testing.assert_close(got, expected, atol=tolerance * expected.abs().max().item(), rtol=tolerance)
    handed = gemv(Fp8Rows(*quantize_fp8(x), x.dtype), quantized, bias, weight_scale=scale, input_mode="fp8")
    assert torch.equal(handed, got)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS])
def test_prefetching_rows_into_the_l2_changes_no_bit(fp8, rows):
    """kernel_config.gemv_prefetch: the programs ask the L2 for their weight rows before their PDL wait (under PDL,
    in a CUDA graph as the engine runs them); the plain and SiLU-mul GEMVs give the same bits as without, split K
    and a row past K's end included."""
    torch.manual_seed(7)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) / 64
    scale = None
    if fp8:
        weight, scale = quantize_fp8(weight)
    for config in ({"BLOCK_N": 16, "BLOCK_K": 256}, {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 4}, None):
        for function in (gemv, gemv_silu_mul):
            if function is gemv_silu_mul and config is not None and "SPLIT_K" in config:
                continue
            call = functools.partial(function, x, weight, weight_scale=scale, config=config, pdl=4,
                                     input_mode="float16" if fp8 else "model_dtype")
            expected = call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call(prefetch=16384)  # 16 KB a row: more than a split's part of K, lines past it masked
            graph.replay()
            assert torch.equal(out, expected), (function.__name__, config)


# ------------------------------------------------------------------ FP8 input quantized a tile at a time


def _fp8_tiles_reference(x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """The "fp8_tiles" input mode in float32: x quantized per row and block of FP8_TILE_K values of K, each block
    multiplied by 448 / its amax and scaled back by amax x (1 / 448) (triton_fp8.tile_scale), then F.linear with the
    dequantized weight."""
    rows, k = x.shape
    blocks = F.pad(x.float(), (0, -k % triton_gemv.FP8_TILE_K)).reshape(rows, -1, triton_gemv.FP8_TILE_K)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-60)
    inverse = torch.full_like(amax, 448.0) / amax  # a division, rounded as the kernel's (448.0 / amax: a reciprocal)
    activations = (blocks * inverse).to(FP8_DTYPE).float() * (amax * torch.tensor(1 / 448.0))
    activations = activations.reshape(rows, -1)[:, :k]
    return F.linear(activations, dequantize_fp8(quantized, scale), None if bias is None else bias.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("tiles", [{"BLOCK_N": 16}, {"BLOCK_N": 32, "SPLIT_K": 2}, {"BLOCK_N": 64, "SWAP_AB": 1},
                                   {"BLOCK_N": 64, "SWAP_AB": 1, "SPLIT_K": 4}], ids=str)
@pytest.mark.parametrize("inputs", ["exact", pytest.param("random", marks=GPU_ONLY)])
def test_fp8_tiles_gemv_is_linear_of_x_quantized_a_block_at_a_time(dtype, rows, tiles, inputs):
    """input_mode "fp8_tiles": x's rows quantized to FP8 in the loop, a scale per row and block of K (FP8_TILE_K, the
    tiles' width) that puts the block's amax on 448, the FP8 product scaled by it as it is added:
    _fp8_tiles_reference to about one unit in the last place, whichever tiling (split K, weight first) runs it, bias
    and a ragged K included."""
    x, quantized, scale, bias = _fp8_case(rows, 100, 600, dtype, True, seed=rows + len(tiles))
    if inputs == "exact":
        x = _fp8_exact_rows(rows, 600, dtype, seed=rows, block=triton_gemv.FP8_TILE_K)
    else:  # blocks of very different magnitudes
        x = x * 10.0 ** torch.arange(-2, 2, device=DEVICE).repeat_interleave(150).to(dtype)
    expected = _fp8_tiles_reference(x, quantized, scale, bias)
    got = gemv(x, quantized, bias, weight_scale=scale, input_mode="fp8_tiles",
               config={**tiles, "BLOCK_K": triton_gemv.FP8_TILE_K})
    assert got.shape == (rows, 100) and got.dtype == dtype
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected.to(dtype), atol=tolerance * expected.abs().max().item(), rtol=tolerance)


def test_fp8_tiles_take_tiles_of_the_quantization_s_width_on_the_tensor_cores():
    """Tiles of another width would quantize x in other blocks (results that follow the tuning), and the CUDA-core
    loop multiplies x as it is: both refused by name. One row takes the tensor cores when no tiling is given."""
    x, quantized, scale, _ = _fp8_case(1, 64, 256, torch.float16, False, seed=2)
    with pytest.raises(ValueError, match="input_mode 'fp8_tiles' takes tiles of BLOCK_K=128"):
        gemv(x, quantized, weight_scale=scale, input_mode="fp8_tiles", config={"BLOCK_N": 16, "BLOCK_K": 256})
    with pytest.raises(ValueError, match="input_mode 'fp8_tiles' takes tiles of BLOCK_K=128"):
        gemv(x, quantized, weight_scale=scale, input_mode="fp8_tiles",
             config={"BLOCK_N": 16, "BLOCK_K": 128, "CORE": 1, "BLOCK_M": 1})
    x = _fp8_exact_rows(1, 256, torch.float16, seed=2, block=triton_gemv.FP8_TILE_K)
    expected = _fp8_tiles_reference(x, quantized, scale, None).half()
    got = gemv(x, quantized, weight_scale=scale, input_mode="fp8_tiles")
    torch.testing.assert_close(got, expected, atol=2e-3 * expected.abs().max().item(), rtol=2e-3)


def test_every_fp8_tiles_tiling_quantizes_in_the_same_blocks():
    from raylm.kernels.gemv_tiles import fp8_tile_candidates

    configs = fp8_tile_candidates(split=True, tile_k=triton_gemv.FP8_TILE_K)
    assert configs and {config.kwargs["BLOCK_K"] for config in configs} == {triton_gemv.FP8_TILE_K}
    assert all(config.kwargs["SWAP_AB"] == 1 and config.kwargs["BLOCK_N"] >= 64 for config in configs)
