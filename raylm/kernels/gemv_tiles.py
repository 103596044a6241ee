"""The decode GEMV's tiles as its tuning chose them on a GPU model, shipped with raylm (gemv_tiles.json).

An engine's start tunes the GEMV per layer shape: it compiles and times every candidate tiling, about 170 for an
FP8 Llama-3.1-8B, which took 75-190 s on a fresh H200 (docs/benchmarks.md). Where the table has the GPU model
(torch's device name), the kernel variant and the layer's (N, K), the engine launches that tiling directly and
compiles only it (kernel_config.gemv_tiles="shipped", the default; "tune" times every tiling on the machine).

`benchmarks/tune_gemv.py` writes the table: it starts an engine that tunes, then merges the tiles each variant's
tuning chose (chosen(), noted by the GEMV as it tunes) into the file. A shipped tiling that is no longer among the
GEMV's candidates is ignored, so the table cannot launch a tiling the kernel no longer offers.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("gemv_tiles.json")

# (device name, variant, "NxK") -> the tiling a tuning in this process chose ({"BLOCK_N": ..., "num_warps": ...}).
_chosen: dict[tuple[str, str, str], dict] = {}


def shape_key(N: int, K: int) -> str:
    return f"{N}x{K}"


@functools.cache
def device_name(device: torch.device) -> str:
    """The GPU model as torch names it ("NVIDIA H200"): the table's first key."""
    return torch.cuda.get_device_name(device)


@functools.cache
def load_table(path: Path = TABLE_PATH) -> dict:
    """{device name: {variant: {"NxK": tiling}}}; empty when the file is missing."""
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def shipped(device: torch.device, variant: str, N: int, K: int) -> dict | None:
    """The shipped tiling of a variant at (N, K) on `device`'s GPU model, or None."""
    return load_table().get(device_name(device), {}).get(variant, {}).get(shape_key(N, K))


def note(device: torch.device, variant: str, N: int, K: int, tiling: dict) -> None:
    """Records the tiling a tuning chose (the first one noted for a key stays)."""
    _chosen.setdefault((device_name(device), variant, shape_key(N, K)), dict(tiling))


def chosen() -> dict:
    """The tilings this process's tunings chose, in the table's layout."""
    table: dict = {}
    for (device, variant, shape), tiling in _chosen.items():
        table.setdefault(device, {}).setdefault(variant, {})[shape] = tiling
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
