"""All-reduce latency on the GPUs of one machine: NCCL against the symmetric-memory one-shot all-reduce
(distributed.SymmetricAllReduce), for the message sizes of tensor-parallel decode steps. Each timing replays
a CUDA graph of 64 all-reduces, as a decode graph issues them (two per layer).

    python benchmarks/allreduce.py                 # 2 GPUs, bf16, hidden 4096 x 1..64 rows

One process per GPU (spawned here); NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import graph_call_us, write_result  # noqa: E402

CALLS = 64


def _time_graph(fn, tensor: torch.Tensor, replays: int = 20) -> float:
    """Microseconds per all-reduce, from a graph of CALLS of them."""
    for _ in range(3):
        fn(tensor)

    def body() -> None:
        for _ in range(CALLS):
            fn(tensor)

    return graph_call_us(body, CALLS, replays)


def _worker(rank: int, world: int, port: int, hidden: int, rows: list[int], out_path: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    group = dist.new_group(list(range(world)))
    from raylm.actors.symmetric_memory import SymmetricAllReduce

    dtype = torch.bfloat16
    symmetric = SymmetricAllReduce(group, device, dtype)

    def nccl(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    results = {}
    for count in rows:
        tensor = torch.ones(count, hidden, dtype=dtype, device=device)
        if symmetric.fits(tensor):
            summed = symmetric(tensor)
            torch.testing.assert_close(summed, torch.full_like(tensor, world))
        entry = {"bytes": tensor.numel() * tensor.element_size(), "nccl_us": _time_graph(nccl, tensor)}
        if symmetric.fits(tensor):
            entry["symmetric_us"] = _time_graph(symmetric, tensor)
        results[str(count)] = entry
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=2) + "\n")
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"benchmarks/allreduce.py needs {args.gpus} CUDA devices, found {torch.cuda.device_count()}")
    import tempfile

    from raylm.actors.transport import free_address

    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "rank0.json"
        mp.spawn(_worker, args=(args.gpus, free_address()[1], args.hidden, args.rows, str(raw)), nprocs=args.gpus)
        results = json.loads(raw.read_text())
    path = write_result(f"allreduce-{args.gpus}gpu-h{args.hidden}", args, {"calls": results})
    print(f"{'rows':>6}{'bytes':>10}{'NCCL (us)':>12}{'symmetric (us)':>16}")
    for count, entry in results.items():
        symmetric = f"{entry['symmetric_us']:.1f}" if "symmetric_us" in entry else "-"
        print(f"{count:>6}{entry['bytes']:>10}{entry['nccl_us']:>12.1f}{symmetric:>16}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
