"""The engine loop built on its own thread (LocalExecutor): the model is loaded, and every step runs, on one thread,
so on a CPU one OpenMP pool serves the engine; a failed build is raised to the caller."""

from __future__ import annotations

import threading

import pytest

import raylm.actors.executor as executor_module
from raylm import LLM, SamplingParams, TokensPrompt
from raylm.actors.engine_loop import EngineLoop, TorchThread
from tests.actors import IdleEngine


def test_a_loop_builds_its_engine_on_its_own_thread_before_start_returns():
    built_on = []

    def build():
        built_on.append(threading.get_ident())
        return IdleEngine()

    loop = EngineLoop(None, outbox=lambda output: None, build=build)
    loop.start()
    try:
        assert isinstance(loop.engine, IdleEngine)
        ran_on = loop.call(lambda engine: threading.get_ident()).result(timeout=10)
    finally:
        loop.stop()
    assert built_on == [ran_on] and ran_on != threading.get_ident()


def test_a_failed_build_raises_from_start_and_ends_the_thread():
    def build():
        raise ValueError("no such model")

    loop = EngineLoop(None, outbox=lambda output: None, build=build)
    with pytest.raises(ValueError, match="no such model"):
        loop.start()
    loop.thread.join(timeout=10)
    assert not loop.thread.is_alive() and loop.engine is None


def test_a_loop_takes_an_engine_or_a_build_function():
    with pytest.raises(ValueError, match="one of them"):
        EngineLoop(None, outbox=lambda output: None)
    with pytest.raises(ValueError, match="one of them"):
        EngineLoop(IdleEngine(), outbox=lambda output: None, build=IdleEngine)


def test_the_local_executor_loads_the_model_on_the_thread_that_steps_it(tiny_model_dirs, monkeypatch):
    starts = []
    original = executor_module.Worker.start

    def start(worker):
        starts.append(threading.get_ident())
        return original(worker)

    monkeypatch.setattr(executor_module.Worker, "start", start)
    llm = LLM(str(tiny_model_dirs["llama"]), executor="local", dtype="float32", skip_tokenizer_init=True,
              max_seq_len=64)
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=3),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        stepped_on = llm._executor.loop.thread.ident
    finally:
        llm.shutdown()
    assert starts == [stepped_on] and stepped_on != threading.get_ident()


def test_a_failed_start_hook_fails_the_build_or_the_loop_never_silently():
    def hook():
        raise RuntimeError("no GPU")

    loop = EngineLoop(None, outbox=lambda output: None, on_thread_start=hook, build=IdleEngine)
    with pytest.raises(RuntimeError, match="no GPU"):
        loop.start()
    outputs = []
    loop = EngineLoop(IdleEngine(), outbox=outputs.append, on_thread_start=hook)
    loop.start()
    loop.thread.join(timeout=10)
    assert isinstance(loop.error, RuntimeError) and "no GPU" in outputs[0].fatal_error


def test_a_torch_thread_runs_calls_until_it_is_handed_to_a_loop():
    """TorchThread (a Ray worker's): run() runs on its one thread and returns or raises there what the call did;
    an EngineLoop given it runs there after the calls, and the thread ends with the loop."""
    torch_thread = TorchThread()
    assert torch_thread.run(threading.get_ident) == torch_thread.thread.ident != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        torch_thread.run(lambda: 1 / 0)
    loop = EngineLoop(IdleEngine(), outbox=lambda output: None, thread=torch_thread)
    loop.start()
    try:
        assert loop.call(lambda engine: threading.get_ident()).result(timeout=10) == torch_thread.thread.ident
        with pytest.raises(RuntimeError, match="runs a loop"):
            torch_thread.run(threading.get_ident)
    finally:
        loop.stop()
    assert not torch_thread.thread.is_alive()
