"""A batch job on a multi-node Ray cluster (ray.cluster_utils.Cluster: a head and two worker nodes on this
machine): the replicas spread over the worker nodes, and a worker node removed mid-job loses no row."""

from __future__ import annotations

import socket
import threading

import pytest

from tests.batch.test_recovery import SAMPLING, _answer_ids, _retried_blocks, _run_while, _WhenReplicasWork, _write_rows


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def cluster():
    """A head without CPUs (nothing of the job runs there) and two worker nodes of 3 CPUs: a replica each, and
    room for the other node's replica when one node goes away."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True,
                                                            "dashboard_port": _free_port()})
    workers = [cluster.add_node(num_cpus=3) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, workers
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow  # ~32 s on the CI machine: a three-node cluster and a node removed mid-job
def test_replicas_spread_over_nodes_and_a_node_removed_mid_job_loses_no_row(cluster, tiny_model_dirs, tmp_path):
    cluster, workers = cluster
    ids = _write_rows(tmp_path / "rows.jsonl", 64)
    output = tmp_path / "out"

    def remove_a_replicas_node(busy, alive: list) -> tuple[set[str], str]:
        doomed = next(worker for worker in workers if worker.node_id == busy.node_id)
        cluster.remove_node(doomed, allow_graceful=False)
        return {actor.node_id for actor in alive}, busy.actor_id

    job_done = threading.Event()
    remover = _WhenReplicasWork(2, remove_a_replicas_node, job_done)
    summary = _run_while(remover, job_done, input=str(tmp_path / "rows.jsonl"), output=str(output),
                         model=str(tiny_model_dirs["llama"]), num_replicas=2, rows_per_block=4, blocks_in_flight=2,
                         sampling=SAMPLING, max_seq_len=128)
    assert remover.error is None and remover.while_running
    replica_nodes, lost_replica = remover.result
    assert replica_nodes == {worker.node_id for worker in workers}  # one replica on each worker node
    assert _retried_blocks(lost_replica) >= 1  # the lost replica's blocks ran again on the surviving node
    answers = _answer_ids(output)
    assert set(answers) == ids and set(answers.values()) == {1}
    assert summary.rows == len(ids) and summary.errors == 0 and summary.generated_tokens == len(ids) * 8
