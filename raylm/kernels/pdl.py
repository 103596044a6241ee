"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step, on Hopper and later GPUs.

A batch-1 decode step is ~290 kernels, and most of its time is the GEMVs streaming weights; between them run
small kernels (RMSNorm, RoPE + KV write, attention, SiLU-mul) during which the weight stream stops, and each
GEMV ramps up from an idle memory system. With PDL a kernel may start while the one before it in the stream is
still running: it calls `pdl_wait` before it reads or writes anything a kernel before it touches, and lets
the next kernel start at once. The GEMV loads its first weight tile before it waits (weights are not written
during a step), so the next layer's weights stream in while the small kernels finish.

Ordering stays that of the stream: every kernel of the chain waits in every program, before its first read of
data an earlier kernel writes and before any write, so a kernel that has passed its wait sees every earlier
kernel complete (the one before it has passed its own wait, and so on). Kernels launched without PDL (cuBLAS,
torch) keep the ordinary full ordering on both sides. Under CUDA graph capture the launches become programmatic
edges of the graph. The GEMV's early weight loads are safe because weights are written only between steps (at
load, or by a worker extension's weight update through collective_rpc), and every step begins with work launched
without PDL (the input copies, the embedding lookup), which starts only once those writes are complete.

When a kernel lets the next one start is RAYLM_PDL's value: `1` (or `start`) at the start of each program, so
the next kernel's programs become resident and wait while this one runs; `after_wait` once each program has
passed its own wait; `exit` only as each program exits (the hardware's implicit trigger), which overlaps just the
next kernel's launch with this one's tail; `tail`: the GEMVs once each program has issued its last weight load
(`pdl_trigger_at_tail`), the other kernels after their wait, so that a GEMV's programs start (and request their
first weight tile) during the small kernels before them, yet never take an SM from a GEMV still streaming. Unless
RAYLM_PDL is set, `tail` for models whose decode steps stream weights and off otherwise (dispatch.py, measured with
`bash benchmarks/h200.sh pdl`); never in the Triton interpreter, which has no grid dependency control.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from raylm.kernels import dispatch
from raylm.kernels.dispatch import PDL_TRIGGERS

_MIN_CAPABILITY = (9, 0)


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= _MIN_CAPABILITY


@functools.cache
def pdl_switch() -> int | None:
    """The trigger mode RAYLM_PDL asks for (0: off; always 0 in the Triton interpreter), None when it is unset;
    read once per process (cache_clear() to read it again)."""
    value = os.environ.get("RAYLM_PDL")
    if value is not None and value.strip().lower() not in PDL_TRIGGERS:
        raise ValueError(f"RAYLM_PDL must be one of {sorted(k for k in PDL_TRIGGERS if k)} or unset, got {value!r}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return None if value is None else PDL_TRIGGERS[value.strip().lower()]


def pdl_requested() -> int:
    """The trigger mode in force: RAYLM_PDL's, or when it is unset the model runner's default (`tail` for models
    whose decode steps stream weights, dispatch.set_weight_streaming; else off)."""
    switch = pdl_switch()
    if switch is not None:
        return switch
    return dispatch.STREAMING_PDL_MODE if dispatch.weight_streaming() else 0


def pdl_enabled(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with PDL: a trigger mode in force (pdl_requested), a CUDA device
    of compute capability 9.0 or later, and compiled (not interpreted) Triton."""
    if device.type != "cuda" or not pdl_requested():
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_options(x: torch.Tensor) -> dict:
    """Launch keywords of a PDL-aware kernel working on x: its USE_PDL switch and Triton's launch_pdl, or none
    (the kernel's USE_PDL defaults to off)."""
    return {"USE_PDL": pdl_requested(), "launch_pdl": True} if pdl_enabled(x.device) else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr, TRIGGER_AT_TAIL: tl.constexpr = False):
    """Waits until every earlier kernel's writes are visible, and lets the next kernel in the stream start
    before (USE_PDL 1), after (2, and 4 unless TRIGGER_AT_TAIL: the kernel calls pdl_trigger_at_tail) or not at
    all (3: it starts as this kernel's programs exit). A no-op unless the kernel was launched with PDL
    (USE_PDL 0)."""
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 2 or (USE_PDL == 4 and not TRIGGER_AT_TAIL):
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_trigger_at_tail(USE_PDL: tl.constexpr):
    """Lets the next kernel start (USE_PDL 4, `tail`), called by a kernel once it has issued its last large load."""
    if USE_PDL == 4:
        tl.extra.cuda.gdc_launch_dependents()
