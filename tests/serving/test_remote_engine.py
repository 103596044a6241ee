"""RemoteEngine and RemoteGeneration over stand-ins for Serve's handle and streaming call: admission errors,
chunks passed on as they come, aborts that cancel the call, the health the ingress reports, and the RL control
broadcast to every replica."""

from __future__ import annotations

import asyncio
import pickle

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from ray.exceptions import ActorDiedError, ActorUnavailableError

import raylm.serving.remote_engine as remote_engine
from raylm import CompletionOutput, RequestOutput
from raylm.engine_client import EngineDeadError
from raylm.engine_spec import EngineInfo
from raylm.results import RequestError
from raylm.rl_api import MemoryReleasedError
from raylm.serving.engine_stream import Admitted, ChunkEncoder, Failed, Rejected
from raylm.serving.remote_engine import EngineDescription, RemoteEngine, RemoteGeneration


class FakeStream:
    """A streaming call's response: yields its messages (raising those that are exceptions), records cancel()."""

    def __init__(self, messages: list, hang: bool = False):
        self.messages = list(messages)
        self.hang = hang
        self.cancelled = False

    async def __anext__(self):
        if not self.messages:
            if self.hang:
                await asyncio.Event().wait()
            raise StopAsyncIteration
        message = self.messages.pop(0)
        if isinstance(message, BaseException):
            raise message
        return message

    def cancel(self) -> None:
        self.cancelled = True


def _chunks(*texts: str, finished_last: bool = True) -> list:
    encoder, tokens, outputs = ChunkEncoder(incremental=True), [], []
    for position, text in enumerate(texts):
        tokens.append(100 + position)
        done = finished_last and position == len(texts) - 1
        completion = CompletionOutput(0, text="".join(texts[:position + 1]), token_ids=list(tokens), text_diff=text,
                                      token_ids_diff=[tokens[-1]], finish_reason="length" if done else None)
        outputs.append(encoder.encode(RequestOutput("7", "Hi", [1, 2], [completion], finished=done)))
    return outputs


def _run(coroutine):
    return asyncio.run(coroutine)


async def _consume(result: RemoteGeneration) -> list:
    return [chunk async for chunk in result]


def test_a_generation_is_admitted_then_passes_its_chunks_on_to_the_last():
    chunks = _chunks("He", "llo", "!")

    async def run():
        result = RemoteGeneration(FakeStream([Admitted("7"), *chunks]), on_engine_unreachable=None)
        await result.admitted()
        return result, [chunk async for chunk in result]

    result, received = _run(run())
    assert result.request_id == "7" and received == chunks
    assert [chunk.completions[0].text for chunk in received] == ["He", "llo", "!"] and received[-1].finished


@pytest.mark.parametrize(("rejected", "error"), [(Rejected("ValueError", "prompt is too long"), ValueError),
                                                 (Rejected("TypeError", "bad prompt"), TypeError),
                                                 (Rejected("EngineDeadError", "shut down"), EngineDeadError),
                                                 (Rejected.from_error(MemoryReleasedError("generation needs kv_cache")),
                                                  MemoryReleasedError)])
def test_a_rejection_raises_what_the_engine_raised(rejected, error):
    with pytest.raises(error, match=rejected.message):
        _run(RemoteGeneration(FakeStream([rejected]), None).admitted())


def test_a_call_to_an_unreachable_replica_is_an_unavailable_engine_at_admission_and_a_request_error_later():
    reported = []
    with pytest.raises(EngineDeadError, match="the engine deployment failed: ActorUnavailableError: .*replica gone"):
        _run(RemoteGeneration(FakeStream([ActorUnavailableError("replica gone", None)]), reported.append).admitted())
    assert len(reported) == 1 and "replica gone" in reported[0]
    with pytest.raises(EngineDeadError, match="ActorDiedError"):
        _run(RemoteGeneration(FakeStream([ActorDiedError()]), reported.append).admitted())
    assert len(reported) == 2
    failing = [Admitted("1"), *_chunks("a", finished_last=False), Failed("engine step failed: boom")]
    with pytest.raises(RequestError, match="boom"):
        _run(_consume(RemoteGeneration(FakeStream(failing), reported.append)))
    with pytest.raises(RequestError, match="ended the request's stream"):
        _run(_consume(RemoteGeneration(FakeStream(failing[:-1]), reported.append)))


TOO_LARGE = AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(), Metadata(),
                        details="Received message larger than max (5000123 vs. 4194304)")


@pytest.mark.parametrize("error", [TOO_LARGE, TypeError("cannot pickle 'generator' object"),
                                   ConnectionError("connection reset")])
def test_a_call_failing_for_its_own_sake_fails_its_request_alone(error):
    reported = []
    with pytest.raises(RequestError, match="the engine deployment failed the request") as info:
        _run(RemoteGeneration(FakeStream([error]), reported.append).admitted())
    assert not isinstance(info.value, EngineDeadError) and reported == []
    with pytest.raises(RequestError, match="failed the request"):
        _run(_consume(RemoteGeneration(FakeStream([Admitted("1"), error]), reported.append)))
    assert reported == []


def test_a_grpc_error_is_reported_by_its_status_and_details():
    with pytest.raises(RequestError, match=r"AioRpcError: RESOURCE_EXHAUSTED: Received message larger than max"):
        _run(RemoteGeneration(FakeStream([TOO_LARGE]), None).admitted())


def test_abort_and_leaving_early_cancel_the_call_once():
    stream = FakeStream([Admitted("1"), *_chunks("a", "b", "c")])

    async def leave_after_one():
        async for _ in RemoteGeneration(stream, None):
            break

    _run(leave_after_one())
    assert stream.cancelled
    finished = FakeStream([Admitted("1"), *_chunks("a")])
    _run(_consume(RemoteGeneration(finished, None)))
    assert not finished.cancelled  # nothing to abort once the last output arrived


def test_cancelling_a_waiting_consumer_aborts_without_reporting_the_engine_down():
    reported = []
    stream = FakeStream([Admitted("1")], hang=True)

    async def run():
        result = RemoteGeneration(stream, reported.append)
        task = asyncio.ensure_future(_consume(result))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _run(run())
    assert stream.cancelled and reported == []


class FakeCall:
    def __init__(self, answer):
        self.answer = answer

    def __await__(self):
        async def resolve():
            if self.answer == "hang":
                await asyncio.Event().wait()
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return resolve().__await__()


class FakeMethod:
    def __init__(self, answer):
        self.answer = answer

    def remote(self, *args):
        return FakeCall(self.answer)


class FakeHandle:
    def __init__(self, dead_reason):
        self.engine_dead_reason = FakeMethod(dead_reason)

    def options(self, **kwargs):
        return self


def _engine(dead_reason) -> RemoteEngine:
    info = EngineInfo(num_blocks=4, block_size=16, max_seq_len=128, vocab_size=10, device="cpu", dtype="float32")
    return RemoteEngine(FakeHandle(dead_reason), tokenizer=None,
                        description=EngineDescription(info, {"maxNumBlocks": 4}, {"total": 1.0}))


def test_health_is_what_the_engine_deployment_reports_or_why_it_cannot(monkeypatch):
    monkeypatch.setattr(remote_engine, "HEALTH_TIMEOUT_S", 0.1)
    assert _run(_engine(None).check_health()) is None
    assert _run(_engine("engine worker 0 died").check_health()) == "engine worker 0 died"
    down = _engine(ConnectionError("no replica"))
    assert _run(down.check_health()) == "the engine deployment is unavailable: ConnectionError: no replica"
    assert down.dead_reason == "the engine deployment is unavailable: ConnectionError: no replica"
    assert "did not answer within 0.1 s" in _run(_engine("hang").check_health())
    engine = _engine(None)
    assert engine.info.max_seq_len == 128 and engine.get_kv_cache_capacity() == {"maxNumBlocks": 4}


class FakeBroadcast:
    def __init__(self, answer):
        self.answer = answer

    async def results_async(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


class FakeReplicas:
    """A handle over engine replicas: broadcast answers each method with one result per replica (or raises)."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.calls = []

    def options(self, **kwargs):
        return self

    def broadcast(self, method, *args):
        self.calls.append((method, args))
        return FakeBroadcast(self.answers.get(method, [None, None]))


def _replicas_engine(answers: dict) -> tuple[RemoteEngine, FakeReplicas]:
    handle = FakeReplicas(answers)
    engine = _engine(None)
    engine._handle = handle
    return engine, handle


def test_rl_control_goes_to_every_replica_whose_answers_are_combined():
    statuses = [[{"tags": {"kv_cache": {"bytes": 8, "resident": False}}}] * 2,
                [{"tags": {"kv_cache": {"bytes": 8, "resident": True}}}]]
    engine, handle = _replicas_engine({"get_weight_version": [3, 2], "get_device_ids": [["a", "b"], ["c"]],
                                       "get_memory_status": statuses})
    _run(engine.pause_generation("keep"))
    _run(engine.update_weights({"a": "x", "c": "y"}))
    _run(engine.release_memory(["kv_cache"]))
    _run(engine.resume_memory(["kv_cache", "model"]))
    _run(engine.resume_generation())
    assert handle.calls == [("pause_generation", ("keep",)), ("update_weights", ({"a": "x", "c": "y"},)),
                            ("release_memory", (["kv_cache"],)), ("resume_memory", (["kv_cache", "model"],)),
                            ("resume_generation", ())]
    assert _run(engine.get_weight_version()) == 2  # the lowest: a replica that missed an update
    assert _run(engine.get_device_ids()) == ["a", "b", "c"]
    assert _run(engine.get_memory_status()) == statuses  # per replica, its ranks


@pytest.mark.parametrize("error", [ValueError("weights hold no entry for device 'c'"),
                                   pickle.UnpicklingError("a weight payload may only hold tensor handles")])
def test_a_replicas_error_is_raised_as_its_engine_raised_it(error):
    from ray.exceptions import RayTaskError

    from_rank = RayTaskError("execute_method", "Traceback (most recent call last): ...", error).as_instanceof_cause()
    from_replica = RayTaskError("update_weights", "Traceback (most recent call last): ...",
                                from_rank).as_instanceof_cause()
    engine, _ = _replicas_engine({"update_weights": from_replica})
    with pytest.raises(type(error)) as info:
        _run(engine.update_weights({"c": "x"}))
    assert info.value is error and str(info.value) == str(error)
