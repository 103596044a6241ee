"""An LLM or AsyncLLM that its driver leaves open: shut down at interpreter exit or when collected, and never
keeping the process alive after its last line."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from raylm import LLM, KvCacheConfig

# Creates an engine, generates, and raises without shutting it down; argv: model dir, "sync"/"async", executor.
DRIVER = textwrap.dedent("""
    import asyncio, sys
    from raylm import AsyncLLM, LLM, SamplingParams
    model, mode, executor = sys.argv[1:]
    kwargs = dict(model=model, executor=executor, max_seq_len=128, kv_cache_config={"max_tokens": 512})

    async def main():
        llm = await AsyncLLM(**kwargs)
        await llm.generate_async([1, 2, 3], SamplingParams(max_tokens=2))
        raise RuntimeError("the driver failed")

    if mode == "async":
        asyncio.run(main())
    else:
        LLM(**kwargs).generate([1, 2, 3], SamplingParams(max_tokens=2))
        raise RuntimeError("the driver failed")
""")


def _run_driver(model_dir, mode: str, executor: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, str(model_dir), mode, executor], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_driver_that_raises_with_a_local_engine_open_exits(tiny_model_dirs, mode):
    run = _run_driver(tiny_model_dirs["llama"], mode, "local", timeout=120)
    assert run.returncode == 1 and "RuntimeError: the driver failed" in run.stderr, run.stderr[-2000:]


def test_a_driver_that_raises_with_an_async_ray_engine_open_exits_promptly(tiny_model_dirs):
    """AsyncLLM starts Ray from a worker thread; the local cluster used to die with that thread when asyncio.run
    ended, and the driver then hung in Ray's exit hooks for a minute before Ray killed it."""
    run = _run_driver(tiny_model_dirs["llama"], "async", "ray", timeout=240)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "RuntimeError: the driver failed" in run.stderr
    assert "Failed to connect to GCS" not in run.stderr


def _engine_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name in ("raylm-engine", "raylm-outputs")]


def _small_llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), executor="local", max_seq_len=128, skip_tokenizer_init=True,
               kv_cache_config=KvCacheConfig(max_tokens=512))


def _wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_the_exit_hook_shuts_down_every_engine_left_open(tiny_model_dirs):
    from raylm.llm import _shutdown_open_llms

    assert not _engine_threads()
    llm = _small_llm(tiny_model_dirs["llama"])
    assert len(_engine_threads()) == 2 and llm.dead_reason is None
    _shutdown_open_llms()
    assert llm.dead_reason == "the engine is shut down"
    assert _wait_until(lambda: not _engine_threads())


def test_an_engine_left_open_stops_when_collected(tiny_model_dirs):
    llm = _small_llm(tiny_model_dirs["llama"])
    assert len(_engine_threads()) == 2
    del llm
    gc.collect()
    assert _wait_until(lambda: not _engine_threads())


def test_shutdown_of_a_local_engine_lets_go_of_its_model_and_cache(tiny_model_dirs):
    """A process that goes on after shutdown (a benchmark, a batch driver starting the next engine) gets the
    model's and the KV cache's memory back; on a GPU the cache of the allocator is emptied too."""
    import weakref

    llm = LLM(model=str(tiny_model_dirs["llama"]), executor="local", max_seq_len=128,
              kv_cache_config=KvCacheConfig(max_tokens=512))
    llm.generate([[1, 2, 3]])
    worker = llm._executor.worker
    model, cache = weakref.ref(worker.runner.model), weakref.ref(worker.runner.kv_caches[0][0])
    llm.shutdown()
    gc.collect()
    assert model() is None and cache() is None
    assert worker.runner is None and worker.engine is None
