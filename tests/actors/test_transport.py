"""actors/transport.py: step plans reach every rank whole; pipelines make their point-to-point links at start-up,
in an order that cannot deadlock."""

from __future__ import annotations

import threading

import pytest
import torch

from raylm.actors import transport


def _broadcast_plans_rank(rank: int, port: int, plans_to_send: list, out_dir: str, channel: bool) -> None:
    import pickle

    import torch
    import torch.distributed as dist

    from raylm.actors.transport import Communicator, PlanChannel, RankLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        plan_channel = PlanChannel.open(rank, 2, "127.0.0.1", dist.group.WORLD, 60.0) if channel else None
        comm = Communicator(rank, RankLayout(tp=2, pp=1), torch.device("cpu"), dist.group.WORLD, None, plan_channel)
        received = [comm.broadcast_plans(plans if rank == 0 else None) for plans in plans_to_send]
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as file:
            pickle.dump(received, file)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("channel", [False, True], ids=["gloo", "plan-channel"])
def test_plans_reach_every_rank_whole(tmp_path, channel):
    """Over gloo a step plan goes out in one message when it fits the first (most decode steps), else in two;
    over the plan channel (one pipeline stage) as one socket message, small or ~200 KB; None (stop) too. Both
    ranks end with rank 0's plans."""
    import multiprocessing
    import pickle

    from raylm.actors.transport import _PLAN_MESSAGE_BYTES, free_address
    from raylm.engine.step_plan import StepPlan

    small = [StepPlan(input_ids=[7], positions=[31], slot_mapping=[31], decode_contexts=[([1, 2], 32)],
                      sample_rows=[0])]
    large = [StepPlan(input_ids=list(range(100_000, 100_000 + _PLAN_MESSAGE_BYTES)),
                      positions=list(range(_PLAN_MESSAGE_BYTES)),
                      prefill_chunks=[(list(range(40)), 0, _PLAN_MESSAGE_BYTES)]), small[0]]
    sent = [small, large, small, None]
    context = multiprocessing.get_context("spawn")
    port = free_address()[1]
    processes = [context.Process(target=_broadcast_plans_rank, args=(rank, port, sent, str(tmp_path), channel))
                 for rank in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    for rank in (0, 1):
        assert pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()) == sent


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2), (2, 3), (1, 4)])
def test_pipeline_links_are_made_at_start_up_without_deadlock(monkeypatch, tp, pp):
    """Each rank makes its links as NCCL does a pair's first transfer: sender and receiver wait for each other.
    Every link a pipeline uses (activations to the next stage, the last stage's outputs to rank 0) is made once,
    and every rank gets through (a rank taking them in another order than its peers would wait forever)."""
    layout = transport.RankLayout(tp=tp, pp=pp)
    meetings: dict[tuple[int, int], threading.Barrier] = {}
    made: list[tuple[int, int]] = []
    lock = threading.Lock()

    def meet(src: int, dst: int) -> None:
        with lock:
            barrier = meetings.setdefault((src, dst), threading.Barrier(2, timeout=5))
        if barrier.wait() == 0:
            with lock:
                made.append((src, dst))

    this_rank = threading.local()
    monkeypatch.setattr(transport.dist, "send", lambda tensor, dst: meet(this_rank.value, dst))
    monkeypatch.setattr(transport.dist, "recv", lambda tensor, src: meet(src, this_rank.value))
    errors = []

    def rank_main(rank: int) -> None:
        this_rank.value = rank
        try:
            transport._connect_pipeline(rank, layout, torch.device("cpu"))
        except Exception as exc:  # a broken barrier: this rank waited for a peer that never came
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(layout.world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    forward = {(layout.rank_of(s, t), layout.rank_of(s + 1, t)) for s in range(pp - 1) for t in range(tp)}
    assert sorted(made) == sorted(forward | {(layout.rank_of(pp - 1, 0), 0)})
