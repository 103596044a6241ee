"""Iteration statistics in the LLM API's format (get_stats, /metrics)."""

from __future__ import annotations

import os
import time

import psutil
import torch

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.scheduler import Scheduler, SchedulerOutput

_PROCESS = psutil.Process(os.getpid())
# Memory figures are read at most once a second: reading them costs more than a step of a small model on a GPU
# (torch.cuda.memory_allocated flattens and sorts every allocator statistic, ~0.2 ms a call).
_MEMORY_REFRESH_S = 1.0
_memory_cache: dict[object, tuple[float, int]] = {}  # what -> (time read, bytes)


def _memory_bytes(what: object, read) -> int:
    now = time.monotonic()
    cached = _memory_cache.get(what)
    if cached is None or now - cached[0] > _MEMORY_REFRESH_S:
        cached = _memory_cache[what] = (now, read())
    return cached[1]


def _resident_bytes() -> int:
    """This process's resident memory."""
    return _memory_bytes("rss", lambda: _PROCESS.memory_info().rss)


def _device_bytes(device: torch.device) -> int:
    """Device memory allocated by this process's tensors (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return _memory_bytes(device, lambda: torch.cuda.memory_allocated(device))


def iteration_stats(
    iteration: int,
    latency_s: float,
    scheduler: Scheduler,
    kv_cache: KVCacheManager,
    out: SchedulerOutput,
    num_completed: int,
    device: torch.device,
) -> dict:
    """One iteration's statistics, keyed as the LLM API documents them."""
    context = {item.request.request_id for item in out.scheduled
               if (item.num_tokens > 1 and not item.drafts) or item.start < item.seq.num_prompt_tokens}
    generation = {item.request.request_id for item in out.scheduled} - context
    return {
        "iter": iteration,
        "iterLatencyMS": latency_s * 1000.0,
        "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
        "numActiveRequests": len(scheduler.running),
        "numQueuedRequests": len(scheduler.waiting),
        "numCompletedRequests": num_completed,
        "maxNumActiveRequests": scheduler.max_batch_size,
        "maxNumTokens": scheduler.max_num_tokens,
        "cpuMemUsage": _resident_bytes(),
        "gpuMemUsage": _device_bytes(device),
        "pinnedMemUsage": 0,
        "kvCacheStats": kv_cache.stats(),
        "inflightBatchingStats": {
            "numScheduledRequests": len({item.request.request_id for item in out.scheduled}),
            "numContextRequests": len(context),
            "numGenRequests": len(generation),
            "numPausedRequests": out.num_preempted,
            "numCtxTokens": sum(item.num_tokens for item in out.prefills),
            "microBatchId": 0,
        },
    }
