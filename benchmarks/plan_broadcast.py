"""Rank 0's cost of sending a step plan to another rank: over gloo (Communicator's broadcast) against the plan
channel (distributed.PlanChannel, TCP). Two processes on this machine; rank 0 times each send while the other
waits in its receive, with a short pause between plans as between engine steps.

    python benchmarks/plan_broadcast.py                 # a batch-1 decode plan, 2,000 sends each way
    python benchmarks/plan_broadcast.py --batch 256     # a 256-sequence decode plan
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402


def _plan(batch: int):
    from raylm.engine.step_plan import StepPlan

    blocks = [list(range(row * 40, row * 40 + 40)) for row in range(batch)]
    return [StepPlan(input_ids=[7] * batch, positions=[620] * batch, slot_mapping=list(range(batch)),
                     decode_contexts=[(b, 621) for b in blocks], sample_rows=list(range(batch)),
                     feed_rows=list(range(batch)), feed_sources=list(range(batch)), greedy=True)]


def _rank(rank: int, port: int, channel: bool, batch: int, sends: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from raylm.actors.transport import Communicator, PlanChannel, RankLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        plan_channel = PlanChannel.open(rank, 2, "127.0.0.1", dist.group.WORLD, 60.0) if channel else None
        comm = Communicator(rank, RankLayout(tp=2, pp=1), torch.device("cpu"), dist.group.WORLD, None, plan_channel)
        plans = _plan(batch)
        times = []
        for _ in range(sends):
            if rank == 0:
                time.sleep(0.0005)
                begin = time.perf_counter()
                comm.broadcast_plans(plans)
                times.append(time.perf_counter() - begin)
            else:
                comm.broadcast_plans(None)
        if rank == 0:
            times.sort()
            queue.put({"median_us": times[len(times) // 2] * 1e6, "p90_us": times[int(len(times) * 0.9)] * 1e6})
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1, help="sequences in the decode plan")
    parser.add_argument("--sends", type=int, default=2000)
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    from raylm.actors.transport import free_address

    context = mp.get_context("spawn")
    result = {}
    for name, channel in (("gloo", False), ("plan_channel", True)):
        queue = context.Queue()
        port = free_address()[1]
        processes = [context.Process(target=_rank, args=(rank, port, channel, args.batch, args.sends, queue))
                     for rank in (0, 1)]
        for process in processes:
            process.start()
        result[name] = queue.get(timeout=300)
        for process in processes:
            process.join(timeout=60)
        print(f"{name:<14} rank 0 sends a plan in {result[name]['median_us']:8.1f} us median "
              f"({result[name]['p90_us']:.1f} p90)")
    path = write_result(f"plan-broadcast-b{args.batch}", args, result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
