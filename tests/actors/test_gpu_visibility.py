"""Which CUDA device a Ray worker computes on when every GPU of its node is visible to it, and when it is."""

from __future__ import annotations

import threading

import pytest

from raylm.actors.engine_loop import EngineLoop
from raylm.actors.ray_worker import cuda_index
from raylm.actors.symmetric_memory import (
    all_reduce_norm_requested,
    symmetric_all_reduce_requested,
    symmetric_memory_requested,
)
from raylm.config import KernelConfig
from tests.actors import IdleEngine


def test_cuda_index_is_ray_gpu_id_when_the_node_shows_every_gpu():
    assert cuda_index("3", None) == 3
    assert cuda_index("0", "") == 0


def test_cuda_index_follows_the_node_cuda_visible_devices():
    assert cuda_index("6", "4,5,6,7") == 2
    assert cuda_index("5", "7, 5") == 1


def test_cuda_index_refuses_a_gpu_the_process_cannot_see():
    with pytest.raises(RuntimeError, match="GPU 2 assigned by Ray"):
        cuda_index("2", "0,1")


def test_the_engine_loop_runs_its_start_hook_on_its_own_thread():
    """A Ray worker binds its GPU (a per-thread setting) on the thread that will step the engine."""
    threads = []
    loop = EngineLoop(IdleEngine(), outbox=lambda output: None,
                      on_thread_start=lambda: threads.append(threading.get_ident()))
    loop.start()
    try:
        ran_on = loop.call(lambda engine: threading.get_ident()).result(timeout=10)
    finally:
        loop.stop()
    assert threads == [ran_on] and ran_on != threading.get_ident()


def test_worker_methods_run_on_the_torch_thread_bound_to_the_gpu(monkeypatch):
    """With every GPU visible, a worker's torch thread (where it loads, builds its cache and then loops) makes the
    worker's GPU its current device first; a method run once that thread's loop has ended binds the GPU on the
    thread it runs on (each concurrency group of the actor has its own threads)."""
    import torch

    from raylm.actors.engine_loop import TorchThread
    from raylm.actors.ray_worker import RayWorker

    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: bound.append((index, threading.get_ident())))

    class _Worker:
        def load_model(self):
            return threading.get_ident()

        def report_device_id(self):
            return threading.get_ident()

    actor = object.__new__(RayWorker)
    actor.gpu_index, actor.worker, actor.loop = 3, _Worker(), None
    actor.torch = TorchThread()
    actor.torch.run(actor.bind_gpu)
    on_torch = actor.torch.thread.ident
    assert actor.load_model() == on_torch and actor.execute_method("report_device_id", (), {}) == on_torch
    assert bound == [(3, on_torch)]
    actor.torch.hand_over(lambda: None).result(timeout=10)  # a loop, ended
    seen = []
    thread = threading.Thread(target=lambda: seen.append(actor.execute_method("report_device_id", (), {})))
    thread.start()
    thread.join()
    assert seen == [bound[-1][1]] and bound[-1] == (3, thread.ident)
    actor.gpu_index = None  # Ray shows the actor its own GPU alone: nothing to bind
    actor.bind_gpu()
    assert len(bound) == 2


@pytest.mark.parametrize(("symm", "norm", "cuda", "cpu"), [
    (None, None, (True, True, True), (False, False, False)),  # the default: on for GPUs
    (False, None, (False, True, True), (False, False, False)),
    (False, False, (False, False, False), (False, False, False)),  # NCCL throughout: workers see their own GPU
    (None, True, (True, True, True), (False, True, False)),  # a CPU run may split the all-reduce, over gloo
])
def test_all_reduce_settings_default_on_for_gpus(symm, norm, cuda, cpu):
    """(symmetric all-reduce, fused norm, every GPU visible) for CUDA and CPU workers, from kernel_config."""
    config = KernelConfig(symmetric_memory_allreduce=symm, fused_allreduce_norm=norm)
    for device, expected in (("cuda", cuda), ("cpu", cpu)):
        assert (symmetric_all_reduce_requested(config, device), all_reduce_norm_requested(config, device),
                symmetric_memory_requested(config, device)) == expected
