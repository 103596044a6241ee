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

When a kernel lets the next one start is the policy's trigger mode (kernel_config.pdl, kernels/policy.py):
`start` at the start of each program, so the next kernel's programs become resident and wait while this one runs;
`after_wait` once each program has passed its own wait; `exit` only as each program exits (the hardware's implicit
trigger), which overlaps just the next kernel's launch with this one's tail; `tail`: the GEMVs once each program
has issued its last weight load (`pdl_trigger_at_tail`), the other kernels after their wait, so that a GEMV's
programs start (and request their first weight tile) during the small kernels before them, yet never take an SM
from a GEMV still streaming. Every Triton kernel of a decode step takes the mode as its `pdl` argument.
"""

from __future__ import annotations

import triton
import triton.language as tl


def launch_options(pdl: int) -> dict:
    """Launch keywords of a PDL-aware kernel for trigger mode `pdl` (kernels/policy.py): its USE_PDL switch and
    Triton's launch_pdl, or none for 0 (the kernel's USE_PDL defaults to off)."""
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {}


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
