"""The next GEMV's weights pulled into L2 while the small kernel before it runs (Hopper and later).

At batch 1 a decode step is weight streaming: Llama-3.1-8B's GEMVs read ~14 GB a step at ~3.85 TB/s. Between
them run small kernels — per layer two RMSNorms (~2 µs each) and the decode attention (~7 µs) — and while they
run the memory system idles: ~0.35 ms a step, most of what separates 4.46 ms/token from 4.2. With
RAYLM_L2_PREFETCH=1 each of those kernels is handed the weight of the GEMV that follows it (the RMSNorm before
qkv: the qkv weight; the attention: o's; the RMSNorm before gate / up: gate / up's; the final RMSNorm: the LM
head's) and, before its own work, its programs share out bulk L2 prefetches (`cp.async.bulk.prefetch.L2`) of
the weight's first PREFETCH_MAX_BYTES, so the weight streams in while the small kernel computes and the GEMV
finds it in L2. (Earlier, the GEMV's own programs prefetched their next tiles; that measured slower: they sat on
SMs waiting for the kernel before them.)

A kernel is done only once its programs have issued their prefetches, and one SM issues them slowly: the first
version gave a whole share of 32 MiB to a batch-1 RMSNorm's one program, and each such kernel took ~300 µs
(~76 GB/s; TP=2 batch 1: 33 ms/token against 3.0). So a kernel with fewer programs than `prefetch_programs`
asks for launches added ones that only prefetch (at most PROGRAM_CHUNKS chunks each) and exit, and a site
prefetches at most PREFETCH_MAX_BYTES, about what HBM streams during a small kernel (RAYLM_L2_PREFETCH_MIB sets
another cap, for tuning it on the GPU).

A prefetch changes no result, and weights are written only between steps (at load, or by a weight update through
collective_rpc), so the kernels issue it before they wait for the kernel before them (kernels/pdl.py). Only for
decode-sized inputs (at most GEMV_MAX_ROWS rows), never in the Triton interpreter. Off until measured on the H200.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from raylm.kernels.dispatch import GEMV_MAX_ROWS, env_flag

# About what HBM streams (~4 TB/s) during a small kernel of ~2 µs and the boundaries around it: the GEMV after
# the kernel reads its first tiles from L2, and the rest keeps streaming from HBM.
PREFETCH_MAX_BYTES = 8 << 20
# Bytes per bulk prefetch instruction: 128 instructions for a whole prefetch at the default cap.
_CHUNK_BYTES = 64 << 10
_CHUNK = tl.constexpr(_CHUNK_BYTES)
# The most chunks one program prefetches (the kernels add programs to keep to it: prefetch_programs).
PROGRAM_CHUNKS = 2
# A program's chunks are lanes of a _LANES-element vector. Triton lays such a vector out one element a thread and
# repeats it over the program's further threads; only the first _LANES threads issue, so each chunk is issued once.
_LANES_COUNT = 32
_LANES = tl.constexpr(_LANES_COUNT)
_PREFETCH_ASM = tl.constexpr("{\n .reg .pred p;\n .reg .u32 t;\n mov.u32 t, %tid.x;\n setp.ne.b32 p, $2, 0;\n"
                             f" setp.lt.and.u32 p, t, {_LANES_COUNT}, p;\n"
                             f" @p cp.async.bulk.prefetch.L2.global [$1], {_CHUNK_BYTES};\n mov.u32 $0, 0;\n}}")
_MIN_CAPABILITY = (9, 0)


@functools.cache
def l2_prefetch_requested() -> bool:
    """RAYLM_L2_PREFETCH=1 (read once per process; cache_clear() to read it again); never when interpreted."""
    return env_flag("RAYLM_L2_PREFETCH") and os.environ.get("TRITON_INTERPRET") != "1"


@functools.cache
def prefetch_max_bytes() -> int:
    """The most bytes a kernel prefetches: RAYLM_L2_PREFETCH_MIB MiB where set, else PREFETCH_MAX_BYTES (read
    once per process; cache_clear() to read it again)."""
    value = os.environ.get("RAYLM_L2_PREFETCH_MIB")
    if value is None:
        return PREFETCH_MAX_BYTES
    try:
        mib = float(value)
    except ValueError:
        mib = 0.0
    if not 0 < mib <= 1024:
        raise ValueError(f"RAYLM_L2_PREFETCH_MIB must be a number of MiB in (0, 1024], got {value!r}")
    return int(mib * 2**20)


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= _MIN_CAPABILITY


def prefetch_args(weight: torch.Tensor | None, rows: int, x: torch.Tensor) -> dict:
    """Launch keywords of a kernel that may prefetch `weight` (the next GEMV's) while it works on `rows` tokens
    of x: the weight and how many of its bytes to prefetch (0: none; x stands in for the weight)."""
    nbytes = 0
    if (weight is not None and x.is_cuda and rows <= GEMV_MAX_ROWS and l2_prefetch_requested()
            and _device_supports(x.device.index if x.device.index is not None else torch.cuda.current_device())):
        nbytes = min(weight.numel() * weight.element_size(), prefetch_max_bytes()) // _CHUNK_BYTES * _CHUNK_BYTES
    return {"prefetch_ptr": weight if nbytes else x, "prefetch_bytes": nbytes, "PREFETCH": nbytes > 0}


def prefetch_programs(args: dict) -> int:
    """How many programs the kernel launched with `args` (prefetch_args) needs at least, so that none prefetches
    more than PROGRAM_CHUNKS chunks (0 without a prefetch)."""
    return -(-args["prefetch_bytes"] // (_CHUNK_BYTES * PROGRAM_CHUNKS))


@triton.jit
def prefetch_share(prefetch_ptr, prefetch_bytes, part, parts, PREFETCH: tl.constexpr):
    """This program's share (`part` of `parts`) of the bulk L2 prefetches of prefetch_bytes (a multiple of the
    chunk) from prefetch_ptr; nothing unless PREFETCH."""
    if PREFETCH:
        chunks = prefetch_bytes // _CHUNK
        per_part = tl.cdiv(chunks, parts)
        first = part * per_part
        last = tl.minimum(first + per_part, chunks)
        base = prefetch_ptr.to(tl.pointer_type(tl.int8))
        for start in range(first, last, _LANES):
            index = start + tl.arange(0, _LANES)
            tl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [base + index.to(tl.int64) * _CHUNK,
                                                                (index < last).to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
