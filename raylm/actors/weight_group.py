"""A process group of its own between a trainer and the engine's ranks, for weights the trainer broadcasts.

The trainer is rank 0 and hosts the group's TCPStore at (master_address, master_port); engine rank r joins as
rank_offset + r. The group stands apart from the engine's own process groups (a store and a ProcessGroupNCCL /
ProcessGroupGloo made directly, no default group), so it can come and go between steps. Every wait has a
timeout: a peer that never joins, or a broadcast that never comes, raises instead of hanging the engine.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")


class WeightUpdateGroup:
    """This rank's membership of a trainer's weight-update group."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                 device: torch.device, timeout_s: float):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("backend='nccl' needs the engine on CUDA devices; use 'gloo' on CPUs")
        if not 0 < rank < world_size:
            raise ValueError(f"the engine's ranks must lie in [1, world_size) ({world_size}), got rank {rank}: the "
                             "trainer is rank 0 and rank_offset + the engine's ranks must fit after it")
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=self.timeout)
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
            else:
                self.group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        except (RuntimeError, dist.DistStoreError) as exc:
            raise TimeoutError(f"could not join the weight-update group at {master_address}:{master_port} within "
                               f"{timeout_s} s: {exc}") from exc

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor rank 0 broadcasts (raises TimeoutError when it does not come in time)."""
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            self.group.broadcast(tensor, 0).wait(self.timeout)
        except RuntimeError as exc:
            raise TimeoutError(f"the trainer's broadcast did not arrive within {self.timeout}: {exc}") from exc
        return tensor

    def destroy(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.group = None
