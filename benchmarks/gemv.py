"""The decode GEMV (kernels/triton_gemv.py) against cuBLAS (F.linear) on the Llama-3.1-8B layer shapes: time per call
and weight bandwidth for 1–8 rows, the tiles the GEMV's tuning chose (a split of K among them), and the sum over
one decode step (32 layers + the LM head); then the gate / up GEMV followed by the SiLU-mul kernel against
gemv_silu_mul, which applies SiLU-mul in its epilogue.

    python benchmarks/gemv.py               # one GPU's shapes
    python benchmarks/gemv.py --tp 2        # the shard of each rank at tensor-parallel size 2
    python benchmarks/gemv.py --fp8         # FP8 weights (per-row scales): the GEMV (weights widened to bf16; both
                                            # in fp16; input quantized to FP8) against torch._scaled_mm
    python benchmarks/gemv.py --fp8 --rows 1 --impls triton_fp16 triton_fp16_dot
                                            # one row: the CUDA-core GEMV against the tensor-core one (in fp16)
    python benchmarks/gemv.py --fp8 --rows 1 --sweep [--input_modes float16 model_dtype fp8]
                                            # every tiling the tuning offers and deeper ones (whole slices of K
                                            # in registers, more pipeline stages, 128 rows first) on qkv / o /
                                            # down, without and under PDL (`tail`): the fastest of each

Each timing replays a CUDA graph of calls over enough copies of the weight (≥ 1 GiB in all) that no call
finds its weight in L2, as in a real step, where every weight is read once.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402

# name: (output features, input features, split by TP along "n" (column parallel) or "k" (row parallel))
LLAMA_8B = {"qkv": (6144, 4096, "n"), "o": (4096, 4096, "k"), "gate_up": (28672, 4096, "n"),
            "down": (4096, 14336, "k"), "lm_head": (128256, 4096, "n")}
LAYERS = 32


def layer_weights(n: int, k: int, dtype: torch.dtype, fp8: bool = False) -> list:
    """Copies of a random [n, k] weight (as quantize_fp8's (FP8 rows, scales) with `fp8`), enough of them (≥ 1 GiB in
    all) that no call finds its weight in L2, as in a real step, where every weight is read once."""
    from raylm.kernels.fp8 import quantize_fp8

    copies = max(2, math.ceil(2**30 / (n * k * (1 if fp8 else dtype.itemsize))))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]
    return [quantize_fp8(w) for w in weights] if fp8 else weights


def time_calls(fn, x: torch.Tensor, weights: list[torch.Tensor], replays: int = 5) -> float:
    """Microseconds per call of fn(x, w), replayed in a CUDA graph over all the weights in turn."""
    for w in weights[:2]:
        fn(x, w)  # tunes / compiles outside the capture

    def body() -> None:
        for w in weights:
            fn(x, w)

    return graph_call_us(body, len(weights), replays)


def tuned_config(variant: tuple[bool, int, bool] = (False, 0, False)) -> str:
    """The tile configuration the GEMV's tuning chose for its last call of a variant (FP8 weight, its input mode:
    triton_gemv.INPUT_MODES, on the CUDA cores): BLOCK_N, BLOCK_K, SPLIT_K if split; "-" if it has not run."""
    from raylm.kernels import triton_gemv

    config = getattr(triton_gemv._gemv_tuned[variant], "best_config", None)
    if config is None:
        return "-"
    tiles = ", ".join(f"{key} {value}" for key, value in config.kwargs.items())
    return f"{tiles}, warps {config.num_warps}, stages {config.num_stages}"


def on_tensor_cores(fn):
    """fn with one-row FP8 GEMVs on the tensor-core dot, as more rows run, instead of the CUDA cores (to time one
    against the other)."""
    from raylm.kernels import triton_gemv

    def call(x, w):
        saved, triton_gemv._CORE_ROWS = triton_gemv._CORE_ROWS, 0
        try:
            return fn(x, w)
        finally:
            triton_gemv._CORE_ROWS = saved

    return call


def time_gate_up_silu(rows: int, tp: int, dtype: torch.dtype) -> dict:
    """The gate / up GEMV followed by the SiLU-mul kernel against gemv_silu_mul (the SiLU-mul in its epilogue)."""
    from raylm.kernels.triton_gemv import gemv, gemv_silu_mul
    from raylm.kernels.triton_ops import silu_and_mul

    n, k, _ = LLAMA_8B["gate_up"]
    n //= tp
    weights = layer_weights(n, k, dtype)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    torch.testing.assert_close(gemv_silu_mul(x, weights[0]), silu_and_mul(gemv(x, weights[0])), atol=2e-2, rtol=2e-2)
    entry = {"separate_us": time_calls(lambda x, w: silu_and_mul(gemv(x, w)), x, weights),
             "fused_us": time_calls(gemv_silu_mul, x, weights)}
    print(f"rows {rows} gate_up + SiLU-mul [{n} x {k}]: GEMV then SiLU-mul {entry['separate_us']:.1f} us, "
          f"SiLU-mul in the GEMV's epilogue {entry['fused_us']:.1f} us", flush=True)
    del weights
    torch.cuda.empty_cache()
    return entry


def sweep_configs(rows: int) -> list[dict]:
    """The tilings --sweep times at `rows` rows on FP8 weights: those the tuning offers, and deeper ones: on the CUDA
    cores (one row) whole slices of K loaded at once (before the PDL wait), on the tensor cores more stages."""
    from raylm.kernels.gemv_tiles import candidates, core_candidates, tiling

    offered = [tiling(config) for config in (core_candidates(split=True) if rows == 1 else [])
               + candidates(split=True, fp8=True)]
    deeper = []
    if rows == 1:
        deeper += [{"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "CORE": 1, "CORE_AHEAD": 1,
                    "num_warps": warps, "num_stages": 1}
                   for block_n, block_k, warps in ((16, 1024, 4), (16, 1024, 8), (16, 2048, 8), (32, 1024, 8))
                   for split_k in (1, 2, 4)]
    deeper += [{"BLOCK_N": block_n, "BLOCK_K": block_k, "SWAP_AB": swap, "num_warps": 4, "num_stages": stages}
               for block_n, block_k in ((16, 512), (32, 512), (16, 1024)) for swap in (0, 1) for stages in (5, 6, 8)
               if not (swap and block_n == 16)]
    deeper += [{"BLOCK_N": 16, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4, "num_stages": stages}
               for block_k in (512, 1024) for split_k in (2, 4) for stages in (5, 6)]
    # 128 weight rows first: with FP8 input, two of Hopper's FP8 warpgroup products a tile, read from shared memory.
    deeper += [{"BLOCK_N": 128, "BLOCK_K": block_k, "SWAP_AB": 1, "num_warps": 4, "num_stages": stages}
               for block_k in (256, 512) for stages in (3, 4)]
    # ... and split K, so that a narrow layer's weight-first tiles still make programs for every SM.
    deeper += [{"BLOCK_N": block_n, "BLOCK_K": 512, "SWAP_AB": 1, "SPLIT_K": split_k, "num_warps": 4,
                "num_stages": 4} for block_n in (64, 128) for split_k in (2, 4)]
    return [config for index, config in enumerate(offered + deeper) if config not in (offered + deeper)[:index]]


def sweep(rows: int, layers: list[str], pdls: list[int], input_modes: list[str]) -> dict:
    """Times every sweep_configs tiling of the FP8 GEMV in each of `input_modes` (kernel_config.fp8_gemv_input; "fp8"
    includes its input's quantizer, "fp8_rows" takes the rows quantized before) on each layer, under each PDL
    trigger mode of `pdls` (0: none; else a graph of back-to-back calls, each one's first tile requested before it
    waits for the one before)."""
    from raylm.kernels.fp8 import Fp8Rows, dequantize_fp8, quantize_fp8
    from raylm.kernels.triton_gemv import gemv

    result: dict = {}
    for name in layers:
        n, k, _ = LLAMA_8B[name]
        weights = layer_weights(n, k, torch.bfloat16, fp8=True)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        expected = F.linear(x.float(), dequantize_fp8(*weights[0])).to(x.dtype)
        handed = Fp8Rows(*quantize_fp8(x), x.dtype)
        timings = []
        for config in sweep_configs(rows):
            if config.get("SPLIT_K", 1) > 1 and k // config["SPLIT_K"] < config["BLOCK_K"]:
                continue
            entry = {"config": config}
            for mode, pdl in ((mode, pdl) for mode in input_modes for pdl in pdls):
                def call(x, w, pdl=pdl, config=config, mode=mode, handed=handed):
                    if mode == "fp8_rows":  # x handed over in FP8, as the RMSNorm before qkv and gate / up writes it
                        return gemv(handed, w[0], weight_scale=w[1], input_mode="fp8", config=config, pdl=pdl)
                    return gemv(x, w[0], weight_scale=w[1], input_mode=mode, config=config, pdl=pdl)
                try:
                    torch.testing.assert_close(call(x, weights[0]), expected, atol=5e-2, rtol=2e-2)
                    micros = time_calls(call, x, weights)
                except Exception as error:  # noqa: BLE001 - a tiling that does not compile or fit is reported
                    entry[f"{mode} pdl{pdl}"] = repr(error)[:200]
                    continue
                entry[f"{mode} pdl{pdl}"] = {"us": micros, "tb_per_s": n * k / micros / 1e6}
            timings.append(entry)
        result[name] = timings
        for setting in (f"{mode} pdl{pdl}" for mode in input_modes for pdl in pdls):
            ranked = sorted((e for e in timings if isinstance(e.get(setting), dict)), key=lambda e: e[setting]["us"])
            for entry in ranked[:4]:
                print(f"rows {rows} {name:<5} {setting}: {entry[setting]['us']:.2f} us "
                      f"({entry[setting]['tb_per_s']:.2f} TB/s) {entry['config']}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--fp8", action="store_true", help="FP8 weights: the GEMV against torch._scaled_mm")
    parser.add_argument("--impls", nargs="+", default=None,
                        help="time only these (with --fp8: scaled_mm, triton, triton_fp16, triton_fp16_dot, "
                             "triton_fp8_input; triton_fp16_dot, one row on the tensor cores too, is not timed "
                             "by default)")
    parser.add_argument("--sweep", action="store_true",
                        help="with --fp8: time every tiling (sweep_configs) on --layers instead of the tuned ones")
    parser.add_argument("--layers", nargs="+", default=["qkv", "o", "down"], help="the layers --sweep times")
    parser.add_argument("--pdl", type=int, nargs="+", default=[0, 4], help="PDL trigger modes --sweep times under")
    parser.add_argument("--input_modes", nargs="+", default=["float16"],
                        help="kernel_config.fp8_gemv_input values --sweep times (float16, model_dtype, fp8; "
                             "fp8_rows: fp8 with x handed over in FP8, no quantizer)")
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gemv.py times CUDA kernels: it needs a GPU")
    if args.sweep:
        if not args.fp8:
            parser.error("--sweep times FP8 weights: add --fp8")
        result = {str(rows): sweep(rows, args.layers, args.pdl, args.input_modes) for rows in args.rows}
        print(f"wrote {write_result('gemv-sweep-llama-3.1-8b-fp8', args, result)}")
        return
    from raylm.kernels import triton_gemv
    from raylm.kernels.fp8 import dequantize_fp8, fp8_linear
    from raylm.kernels.triton_gemv import gemv

    dtype = torch.bfloat16
    if args.fp8:  # a weight is (FP8 rows, their scales)
        impls = {"scaled_mm": lambda x, w: fp8_linear(x, *w), "triton": lambda x, w: gemv(x, w[0], weight_scale=w[1]),
                 "triton_fp16": lambda x, w: gemv(x, w[0], weight_scale=w[1], input_mode="float16"),
                 "triton_fp16_dot": on_tensor_cores(lambda x, w: gemv(x, w[0], weight_scale=w[1],
                                                                      input_mode="float16")),
                 "triton_fp8_input": lambda x, w: gemv(x, w[0], weight_scale=w[1], input_mode="fp8")}
        chosen = args.impls or [impl for impl in impls if impl != "triton_fp16_dot"]
    else:
        impls = {"cublas": lambda x, w: F.linear(x, w), "triton": gemv}
        chosen = args.impls or list(impls)
    unknown = sorted(set(chosen) - set(impls))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; choose from {sorted(impls)}")
    impls = {impl: impls[impl] for impl in chosen}
    result: dict = {}
    for rows in args.rows:
        per_step = dict.fromkeys(impls, 0.0)
        for name, (n, k, split) in LLAMA_8B.items():
            n, k = (n // args.tp, k) if split == "n" else (n, k // args.tp)
            nbytes = n * k * (1 if args.fp8 else 2)
            weights = layer_weights(n, k, dtype, args.fp8)
            x = torch.randn(rows, k, device="cuda", dtype=dtype)
            expected = F.linear(x.float(), dequantize_fp8(*weights[0]) if args.fp8 else weights[0].float()).to(dtype)
            for impl in ("triton", "triton_fp16", "triton_fp16_dot"):
                if impl in impls:
                    torch.testing.assert_close(impls[impl](x, weights[0]), expected, atol=5e-2, rtol=2e-2)
            entry = {}
            core = args.fp8 and rows <= triton_gemv._CORE_ROWS
            variants = {"triton": (args.fp8, 0, core), "triton_fp16": (True, 1, core),
                        "triton_fp16_dot": (True, 1, False), "triton_fp8_input": (True, 2, core)}
            for impl, fn in impls.items():
                micros = time_calls(fn, x, weights)
                entry[impl] = {"us": micros, "tb_per_s": nbytes / micros / 1e6}
                if impl in variants:
                    entry[impl]["config"] = tuned_config(variants[impl])
                per_step[impl] += micros * (1 if name == "lm_head" else LAYERS)
            result.setdefault(str(rows), {})[name] = entry
            timings = ", ".join(f"{impl} {entry[impl]['us']:.1f} us ({entry[impl]['tb_per_s']:.2f} TB/s)"
                                + (f" [{entry[impl]['config']}]" if "config" in entry[impl] else "")
                                for impl in impls)
            print(f"rows {rows} {name:<8} [{n} x {k}]: {timings}", flush=True)
            del weights
            torch.cuda.empty_cache()
        result[str(rows)]["decode_step_ms"] = {impl: us / 1000 for impl, us in per_step.items()}
        print(f"rows {rows}: linear layers of one decode step: " + ", ".join(
            f"{impl} {us / 1000:.3f} ms" for impl, us in per_step.items()), flush=True)
        if not args.fp8:
            result[str(rows)]["gate_up_silu_mul"] = time_gate_up_silu(rows, args.tp, dtype)
    suffix = (f"-tp{args.tp}" if args.tp > 1 else "") + ("-fp8" if args.fp8 else "")
    path = write_result(f"gemv-llama-3.1-8b{suffix}", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
