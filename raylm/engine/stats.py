"""Iteration statistics in the LLM API's format (get_stats, /metrics)."""

from __future__ import annotations

import os
import time

import psutil
import torch

from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.scheduler import Scheduler, SchedulerOutput

_PROCESS = psutil.Process(os.getpid())
_RSS_REFRESH_S = 1.0
_rss_cache = [0.0, 0]  # (time read, bytes)


def _resident_bytes() -> int:
    """This process's resident memory, read at most once a second (reading it costs more than a step of a
    small model on a GPU)."""
    now = time.monotonic()
    if now - _rss_cache[0] > _RSS_REFRESH_S:
        _rss_cache[:] = [now, _PROCESS.memory_info().rss]
    return _rss_cache[1]


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
               if item.num_tokens > 1 or item.start < item.seq.num_prompt_tokens}
    generation = {item.request.request_id for item in out.scheduled} - context
    gpu_memory = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
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
        "gpuMemUsage": gpu_memory,
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
