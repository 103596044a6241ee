"""Batch jobs lose no row and answer none twice when replicas die: a replica's actor killed mid-job, and a write task
run again (test_multi_node.py removes a worker node mid-job with the helpers here)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from raylm.batch import run_batch
from raylm.batch.rows import KEY, LINE, AnswersDatasink, written_keys

SAMPLING = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
# Blocks long enough that the one the state API still reports running is running when its replica is killed (with
# 8 tokens a row it had sometimes finished, and nothing was left to retry).
LONG_SAMPLING = {**SAMPLING, "max_tokens": 48}


def _write_rows(path: Path, count: int) -> set[str]:
    """`count` table rows with ids; returns the ids."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Question {i} is about"}) + "\n"
                            for i in range(count)))
    return {f"q{i}" for i in range(count)}


def _answer_ids(output: Path) -> Counter:
    return Counter(json.loads(line)["row_id"] for file in output.glob("*.jsonl")
                   for line in file.read_text().splitlines())


def _replicas() -> list[SimpleNamespace]:
    """The batch replicas' actors (Ray Data's map workers), alive or dead: actor_id, state, pid, node_id and
    num_restarts, from the GCS's actor table (the state API's dashboard answers too slowly on a busy machine)."""
    from ray._private.state import actors

    return [SimpleNamespace(actor_id=actor["ActorID"], state=actor["State"], pid=actor["Pid"],
                            node_id=actor["Address"]["NodeID"], num_restarts=actor["NumRestarts"])
            for actor in actors().values() if "BatchReplica" in actor["ActorClassName"]]


def _blocks(actor_id: str) -> list:
    """The calls by which Ray Data handed the replica `actor_id` its blocks, one a block and attempt, as the state
    API reports them."""
    import ray
    from ray.util.state import list_tasks

    calls = list_tasks(address=ray.get_runtime_context().gcs_address,  # this cluster, not others on the machine
                       filters=[("actor_id", "=", actor_id)], limit=10_000, raise_on_missing_output=False)
    return [call for call in calls if call.name.endswith(".submit")]


def _retried_blocks(actor_id: str) -> int:
    """Blocks of the replica `actor_id` that Ray handed it again (attempt 1 and up) after it died."""
    return sum(call.attempt_number > 0 for call in _blocks(actor_id))


class _WhenReplicasWork(threading.Thread):
    """Runs `action(busy, alive)` once `count` replicas are up and one of them (`busy`) is answering a block, and
    records whether the job was still running when it did."""

    def __init__(self, count: int, action, job_done: threading.Event):
        super().__init__(daemon=True)
        self.count, self.action, self.job_done = count, action, job_done
        self.result, self.error, self.while_running = None, None, False

    def run(self) -> None:
        try:
            while not self.job_done.is_set():
                alive = [actor for actor in _replicas() if actor.state == "ALIVE" and actor.pid]
                busy = [actor for actor in alive if len(alive) >= self.count and any(
                    call.state == "RUNNING" for call in _blocks(actor.actor_id))]
                if busy:
                    self.result = self.action(busy[0], alive)
                    self.while_running = not self.job_done.is_set()
                    return
                time.sleep(0.1)
        except Exception as error:  # reported by the test, not lost in the thread
            self.error = error


def _run_while(action_thread: _WhenReplicasWork, job_done: threading.Event, **job):
    """Runs a job while `action_thread` waits for its moment. Ray Data is told to start the blocks only once every
    replica is up: otherwise, on this busy machine, one replica may answer every block before the next is up."""
    from ray.data import DataContext

    context = DataContext.get_current()
    wait_before = context.wait_for_min_actors_s
    context.wait_for_min_actors_s = 300
    action_thread.start()
    try:
        return run_batch(**job)
    finally:
        context.wait_for_min_actors_s = wait_before
        job_done.set()
        action_thread.join(timeout=60)


def test_a_retried_write_rewrites_its_own_file_so_no_answer_is_written_twice(tmp_path):
    sink = AnswersDatasink(str(tmp_path / "out"))
    sink.on_write_start()
    block = pa.table({KEY: ["row:a", "row:b"], LINE: ['{"row_id": "a"}', '{"row_id": "b"}'],
                      "failed": [False, False], "input_tokens": [3, 4], "generated_tokens": [1, 2],
                      "rows_in_flight": [2, 2], "started": [1.0, 1.0], "finished": [2.0, 2.0]})
    task = SimpleNamespace(task_idx=5)
    sink.write([block], task)
    sink.write([block], task)  # the same write task run again (Ray retried it after its worker died)
    sink.write([block.slice(1)], SimpleNamespace(task_idx=6))
    assert _answer_ids(tmp_path / "out") == Counter({"a": 1, "b": 2})
    assert len(list((tmp_path / "out").glob("*.jsonl"))) == 2


@pytest.mark.usefixtures("ray_cluster")
def test_a_replica_killed_mid_job_has_its_blocks_retried_and_every_row_is_answered_once(tiny_model_dirs,
                                                                                         tmp_path):
    ids = _write_rows(tmp_path / "rows.jsonl", 64)
    output = tmp_path / "out"

    def kill_a_replica(busy, alive: list) -> str:
        os.kill(busy.pid, signal.SIGKILL)
        return busy.actor_id

    job_done = threading.Event()
    killer = _WhenReplicasWork(2, kill_a_replica, job_done)
    summary = _run_while(killer, job_done, input=str(tmp_path / "rows.jsonl"), output=str(output),
                         model=str(tiny_model_dirs["llama"]), num_replicas=2, rows_per_block=4, blocks_in_flight=2,
                         sampling=LONG_SAMPLING, max_seq_len=128)
    assert killer.error is None and killer.while_running
    killed = next(actor for actor in _replicas() if actor.actor_id == killer.result)
    assert killed.num_restarts >= 1  # Ray Data brought the replica back ...
    assert _retried_blocks(killed.actor_id) >= 1  # ... and ran the blocks it was answering again
    answers = _answer_ids(output)
    assert set(answers) == ids and set(answers.values()) == {1}
    assert summary.rows == len(ids) and summary.errors == 0
    assert summary.generated_tokens == len(ids) * LONG_SAMPLING["max_tokens"]
    assert written_keys(str(output)) == {f"row:{i}" for i in ids}
