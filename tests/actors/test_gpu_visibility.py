"""Which CUDA device a Ray worker computes on when every GPU of its node is visible to it."""

from __future__ import annotations

import threading

import pytest

from raylm.actors.engine_loop import EngineLoop
from raylm.actors.ray_worker import cuda_index


def test_cuda_index_is_ray_gpu_id_when_the_node_shows_every_gpu():
    assert cuda_index("3", None) == 3
    assert cuda_index("0", "") == 0


def test_cuda_index_follows_the_node_cuda_visible_devices():
    assert cuda_index("6", "4,5,6,7") == 2
    assert cuda_index("5", "7, 5") == 1


def test_cuda_index_refuses_a_gpu_the_process_cannot_see():
    with pytest.raises(RuntimeError, match="GPU 2 assigned by Ray"):
        cuda_index("2", "0,1")


class _IdleEngine:
    """Just enough of an engine for the loop to take calls: never any work, nothing to drain."""

    has_work = False

    def drain(self):
        return None


def test_the_engine_loop_runs_its_start_hook_on_its_own_thread():
    """A Ray worker binds its GPU (a per-thread setting) on the thread that will step the engine."""
    threads = []
    loop = EngineLoop(_IdleEngine(), outbox=lambda output: None,
                      on_thread_start=lambda: threads.append(threading.get_ident()))
    loop.start()
    try:
        ran_on = loop.call(lambda engine: threading.get_ident()).result(timeout=10)
    finally:
        loop.stop()
    assert threads == [ran_on] and ran_on != threading.get_ident()
