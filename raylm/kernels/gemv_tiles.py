"""The decode GEMV's tiles (kernels/triton_gemv.py): the candidates its tuning times, and those the tuning chose on a
GPU model, shipped with raylm (gemv_tiles.json).

An engine's start tunes the GEMV per layer shape: it compiles and times every candidate tiling, about 170 for an
FP8 Llama-3.1-8B, which took 75-190 s on a fresh H200 (docs/benchmarks.md). Where the table has the GPU model
(torch's device name), the kernel variant and the layer's (N, K), the engine launches that tiling directly and
compiles only it (kernel_config.gemv_tiles="shipped", the default; "tune" times every tiling on the machine).

`benchmarks/tune_gemv.py` writes the table: it starts an engine that tunes, then merges the tiles each variant's
tuning chose (chosen(), noted by the GEMV as it tunes) into the file. A shipped tiling that is no longer among the
GEMV's candidates is ignored, so the table cannot launch a tiling the kernel no longer offers.

Where a shape is tuned, compiling the candidates costs most of the time (seconds each, timing one a few ms); autotune()
compiles them in threads before it times them: Triton's compiler leaves the GIL (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton

MIN_BLOCK_N = 16  # the narrowest output tile of any configuration: one arrival counter per such tile
SPLITS = (2, 4)  # the split-K factors tuned
MAX_SPLIT_N = 16384  # split K only for layers of at most this many output features (enough programs above)
TABLE_PATH = Path(__file__).with_name("gemv_tiles.json")

# (device name, variant, N, K) -> the tiling a tuning in this process chose ({"BLOCK_N": ..., "num_warps": ...}).
_chosen: dict[tuple[str, str, int, int], dict] = {}


def candidates(split: bool = False, fp8: bool = False) -> list[triton.Config]:
    """Tile shapes to time per (N, K), with split-K ones if `split`; Triton's timing clears the L2 between runs,
    as a real step finds it. FP8 weights (`fp8`) get K tiles twice as wide: the same bytes per tile; and tiles
    whose dot takes the weight first (SWAP_AB), to be timed against those that take it transposed."""
    widen = 2 if fp8 else 1
    configs = [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k * widen}, num_warps=4, num_stages=stages)
               for block_n in (16, 32, 64) for block_k in (128, 256) for stages in (3, 4)]
    # Wider K tiles with more warps keep more bytes of W in flight per SM when there are few programs.
    configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": 512 * widen}, num_warps=8, num_stages=stages)
                for block_n in (16, 32) for stages in (2, 3)]
    if fp8:  # the weight tile as the dot's first operand (SWAP_AB), as stored: no reordering of FP8 values
        configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SWAP_AB": 1}, num_warps=4,
                                  num_stages=stages)
                    for block_n in (32, 64) for block_k in (256, 512) for stages in (3, 4)]
    if split:
        configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k * widen, "SPLIT_K": split_k},
                                  num_warps=4, num_stages=3)
                    for block_n in (MIN_BLOCK_N, 32) for block_k in (128, 256) for split_k in SPLITS]
        if fp8:  # 64 weight rows first leave a narrow layer few programs (qkv: 96 for 132 SMs): split K too
            configs += [triton.Config({"BLOCK_N": 64, "BLOCK_K": 512, "SWAP_AB": 1, "SPLIT_K": split_k}, num_warps=4,
                                      num_stages=3) for split_k in SPLITS]
    return configs


def fp8_tile_candidates(split: bool = False, tile_k: int = 128) -> list[triton.Config]:
    """Tile shapes to time for the "fp8_tiles" input mode, x quantized in the loop per row and tile of K: every tile
    tile_k wide in K (the quantization's block, so that all tilings give the same results) and its weight rows first
    (Hopper's FP8 warpgroup product), deeper pipelines in place of wider tiles. Each tile's quantization is a fixed
    cost, so wide tiles take fewer instructions a weight byte (sm_90: 3.7 at 64 rows, 2.2 at 128, 1.6 at 256 on 8
    warps, against ~7 for one row on the CUDA cores)."""
    shapes = [(64, 4, (4, 6, 8)), (128, 4, (4, 6)), (128, 8, (4, 6)), (256, 8, (3, 4))]
    configs = [triton.Config({"BLOCK_N": block_n, "BLOCK_K": tile_k, "SWAP_AB": 1}, num_warps=warps,
                             num_stages=stages) for block_n, warps, depths in shapes for stages in depths]
    if split:  # a narrow layer (o, down: 4,096 rows) leaves 128-row tiles 32 programs
        configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": tile_k, "SWAP_AB": 1, "SPLIT_K": split_k},
                                  num_warps=4, num_stages=4) for block_n in (64, 128) for split_k in SPLITS]
    return configs


def core_candidates(split: bool = False) -> list[triton.Config]:
    """Tile shapes to time for one row of x against FP8 weights on the CUDA cores (CORE). Their loads are not
    pipelined by Triton (the loop requests its next tiles itself: CORE_AHEAD 1 or 2), so one stage; 60-96 registers
    a thread (ptxas, sm_90). Tiles of 8 warps (BLOCK_N x BLOCK_K of 16 x 1024, 32 x 512, 64 x 256) were timed on the
    H200 too and never chosen for an 8B layer."""
    shapes = [(16, 256), (16, 512), (32, 256)]
    configs = [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "CORE": 1, "CORE_AHEAD": ahead}, num_warps=4,
                             num_stages=1)
               for block_n, block_k in shapes for ahead in (1, 2)]
    if split:
        configs += [triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "CORE": 1,
                                   "CORE_AHEAD": ahead}, num_warps=4, num_stages=1)
                    for block_n, block_k in shapes for split_k in SPLITS for ahead in (1, 2)
                    if ahead == 1 or split_k == 2]
    return configs


class _ThreadedAutotuner(triton.runtime.Autotuner):
    """Triton's autotuner, which compiles the configurations it is about to time in threads first, so that the
    timing finds each one compiled. Only where it times: a shape whose timings Triton's cache holds (cache_results)
    compiles just its chosen configuration, as before."""

    _call: tuple[tuple, dict] | None = None  # the arguments of the run in progress

    def run(self, *args, **kwargs):
        self._call = (args, kwargs)
        try:
            return super().run(*args, **kwargs)
        finally:
            self._call = None

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        def compile_then_time() -> None:
            compile_in_threads(self.fn, configs, *self._call)
            bench_fn()

        return super().check_disk_cache(tuning_key, configs, compile_then_time)


def autotune(kernel, configs: list[triton.Config], prune_configs_by: dict | None = None) -> triton.runtime.Autotuner:
    """triton.autotune(configs, key=["N", "K"], cache_results=True) of `kernel`, compiling its configurations in
    threads before it times them (_ThreadedAutotuner). The tuning results go to Triton's cache directory too, so
    an engine's later starts on the machine take the same tiles without timing them again."""
    return _ThreadedAutotuner(kernel, kernel.arg_names, configs, ["N", "K"], None, None,
                              prune_configs_by=prune_configs_by, cache_results=True)


def compile_in_threads(kernel, configs: list[triton.Config], args: tuple, kwargs: dict) -> None:
    """Compiles `kernel` for each configuration as a launch with args / kwargs would (Triton's warm-up: nothing
    runs on the device), the first in this thread, which sets up the kernel's per-device caches, the rest in up to
    one thread per CPU this process may use (none if the first failed). A configuration that fails to compile is
    left to the tuning, which meets the same error and skips it as it always has."""
    if len(configs) < 2:
        return
    device = torch.cuda.current_device()
    warm_up = {**kwargs, "warmup": True}

    def compile_one(config: triton.Config) -> bool:
        torch.cuda.set_device(device)  # a thread's current device starts at 0
        try:
            kernel.run(*args, **warm_up, **config.all_kwargs())
        except Exception:  # noqa: BLE001 - the tuning compiles it again and handles the error as Triton does
            return False
        return True

    if not compile_one(configs[0]):
        return  # whatever failed would likely fail every thread: the tuning compiles one by one as it times
    with ThreadPoolExecutor(min(len(configs) - 1, len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(compile_one, configs[1:]))


def without_splits_for_wide_layers(configs: list[triton.Config], named_args: dict, **_) -> list[triton.Config]:
    """The autotuner's pruning: split-K configurations only for layers of at most MAX_SPLIT_N features."""
    if named_args["N"] <= MAX_SPLIT_N:
        return configs
    return [config for config in configs if config.kwargs.get("SPLIT_K", 1) == 1]


def tiling(config: triton.Config) -> dict:
    """A tuning configuration as gemv's `config` takes it (and gemv_tiles.json stores it)."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def shape_key(N: int, K: int) -> str:
    return f"{N}x{K}"


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU model as torch names it ("NVIDIA H200"): the table's first key; another device's type ("cpu", where
    Triton's interpreter runs the GEMV), which the table never holds."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


@functools.cache
def load_table(path: Path = TABLE_PATH) -> dict:
    """{device name: {variant: {"NxK": tiling}}}; empty when the file is missing."""
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def shipped(device: torch.device, variant: str, N: int, K: int) -> dict | None:
    """The shipped tiling of a variant at (N, K) on `device`'s GPU model, or None."""
    return load_table().get(device_name(device), {}).get(variant, {}).get(shape_key(N, K))


def note(device: torch.device, variant: str, N: int, K: int, config: triton.Config) -> None:
    """Records the tiling a tuning chose (the first one noted for a key stays). Called on every tuned launch: a
    key already noted costs a lookup."""
    key = (device_name(device), variant, N, K)
    if key not in _chosen:
        _chosen[key] = tiling(config)


def chosen() -> dict:
    """The tilings this process's tunings chose, in the table's layout."""
    table: dict = {}
    for (device, variant, N, K), tiles in _chosen.items():
        table.setdefault(device, {}).setdefault(variant, {})[shape_key(N, K)] = tiles
    return table


def merged(table: dict, new: dict) -> dict:
    """`table` with `new`'s tilings added, those of the same (device, variant, shape) replaced."""
    result = json.loads(json.dumps(table))
    for device, variants in new.items():
        for variant, shapes in variants.items():
            result.setdefault(device, {}).setdefault(variant, {}).update(shapes)
    return result


def dumps(table: dict) -> str:
    """The table as JSON with one tiling a line, sorted, so that a change reads as a short diff."""
    lines = ["{"]
    devices = sorted(table)
    for d, device in enumerate(devices):
        lines.append(f"  {json.dumps(device)}: {{")
        variants = sorted(table[device])
        for v, variant in enumerate(variants):
            lines.append(f"    {json.dumps(variant)}: {{")
            shapes = sorted(table[device][variant], key=lambda s: tuple(int(n) for n in s.split("x")))
            for s, shape in enumerate(shapes):
                comma = "," if s < len(shapes) - 1 else ""
                lines.append(f"      {json.dumps(shape)}: {json.dumps(table[device][variant][shape], sort_keys=True)}"
                             f"{comma}")
            lines.append("    }" + ("," if v < len(variants) - 1 else ""))
        lines.append("  }" + ("," if d < len(devices) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"
