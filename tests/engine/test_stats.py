"""Iteration statistics: their memory figures are read at most once a second, not at every step."""

from __future__ import annotations

import torch

from raylm.engine import stats
from raylm.engine.kv_cache import KVCacheManager
from raylm.engine.scheduler import Scheduler, SchedulerOutput


def test_memory_figures_are_read_at_most_once_a_second(monkeypatch):
    reads = []

    def memory_allocated(device):
        reads.append(device)
        return 1000 * len(reads)

    monkeypatch.setattr(torch.cuda, "memory_allocated", memory_allocated)
    monkeypatch.setattr(stats, "_memory_cache", {})
    kv_cache = KVCacheManager(16, 4, True)
    scheduler = Scheduler(kv_cache, max_batch_size=4, max_num_tokens=64)
    device = torch.device("cuda", 0)
    first = [stats.iteration_stats(i, 0.001, scheduler, kv_cache, SchedulerOutput(), 0, device) for i in range(50)]
    assert len(reads) == 1
    assert {entry["gpuMemUsage"] for entry in first} == {1000}
    assert all(entry["cpuMemUsage"] > 0 for entry in first)
    monkeypatch.setattr(stats, "_MEMORY_REFRESH_S", -1.0)  # every read is stale
    assert stats.iteration_stats(50, 0.001, scheduler, kv_cache, SchedulerOutput(), 0, device)["gpuMemUsage"] == 2000
    assert stats.iteration_stats(51, 0.001, scheduler, kv_cache, SchedulerOutput(), 0,
                                 torch.device("cpu"))["gpuMemUsage"] == 0
