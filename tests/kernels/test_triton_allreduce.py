"""The all-reduce fused with the residual add and RMSNorm (kernels/triton_allreduce.py), as one rank of a group
whose other ranks this process plays: their exchange buffers and flags are ordinary tensors here, their rows and
raised flags written in beforehand, so the kernel never waits. The real exchange between GPUs is tested on two
GPUs (tests/actors/test_multi_gpu.py) and, on one GPU, by two streams playing two ranks."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import GPU_ONLY, MODULE_MARKS, kernel_device

DEVICE = kernel_device()

from raylm.kernels.triton_allreduce import all_reduce_add_rms_norm  # noqa: E402
from raylm.kernels.triton_ops import fused_add_rms_norm  # noqa: E402

pytestmark = MODULE_MARKS

MAX_ROWS = 4


class Group:
    """Exchange buffers, flags and each rank's state for a group of `world` ranks, all in this process."""

    def __init__(self, world: int, hidden: int, dtype: torch.dtype):
        self.buffers = [torch.zeros(2, world, MAX_ROWS, hidden, dtype=dtype, device=DEVICE) for _ in range(world)]
        self.flags = [torch.zeros(2, world, MAX_ROWS, dtype=torch.int32, device=DEVICE) for _ in range(world)]
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEVICE)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64,
                                      device=DEVICE)
        self.states = [torch.zeros(2, dtype=torch.int32, device=DEVICE) for _ in range(world)]

    def arrive(self, rank: int, source: int, parity: int, rows: torch.Tensor) -> None:
        """Rank `source` has written its rows into `rank`'s buffer and raised its flags there."""
        self.buffers[rank][parity, source, : rows.shape[0]] = rows
        self.flags[rank][parity, source, : rows.shape[0]] = 1

    def call(self, rank: int, partial, residual, weight, eps=1e-5):
        return all_reduce_add_rms_norm(partial, residual, weight, eps, buffers=self.buffer_ptrs, flags=self.flag_ptrs,
                                       state=self.states[rank], rank=rank, max_rows=MAX_ROWS)


def _reference(partials: list[torch.Tensor], residual, weight, eps=1e-5):
    total = torch.zeros_like(partials[0], dtype=torch.float32)
    for part in partials:  # rank order, in float32, rounded once
        total += part.float()
    return fused_add_rms_norm(total.to(partials[0].dtype), residual, weight, eps)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, marks=GPU_ONLY, id="bf16")])
@pytest.mark.parametrize("world, rank", [(1, 0), (2, 0), (2, 1), (4, 2)])
def test_one_rank_sums_in_rank_order_adds_the_residual_and_normalises(dtype, world, rank):
    hidden, rows = 96, 3  # not a power of two: masked columns
    generator = torch.Generator().manual_seed(world * 10 + rank)
    partials = [torch.randn(rows, hidden, generator=generator).to(DEVICE, dtype) for _ in range(world)]
    residual = torch.randn(rows, hidden, generator=generator).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(DEVICE, dtype)
    group = Group(world, hidden, dtype)
    for source in range(world):
        if source != rank:
            group.arrive(rank, source, 0, partials[source])

    out, new_residual = group.call(rank, partials[rank], residual, weight)

    expected_out, expected_residual = _reference(partials, residual, weight)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    for peer in range(world):  # this rank's rows went to every other rank, with their flags raised there
        if peer != rank:
            assert torch.equal(group.buffers[peer][0, rank, :rows], partials[rank])
            assert group.flags[peer][0, rank, :rows].tolist() == [1] * rows
            assert group.flags[peer][0, rank, rows:].tolist() == [0] * (MAX_ROWS - rows)
    assert not group.flags[rank].any()  # the flags raised here were lowered as they were read
    assert group.states[rank].tolist() == [1, 0]  # one call: the next uses the other half


def test_consecutive_calls_alternate_halves():
    hidden, world, rank = 64, 2, 1
    group = Group(world, hidden, torch.float32)
    weight = torch.ones(hidden, device=DEVICE)
    generator = torch.Generator().manual_seed(3)
    for call in range(3):
        parity = call % 2
        mine, theirs, residual = (torch.randn(2, hidden, generator=generator).to(DEVICE) for _ in range(3))
        group.arrive(rank, 0, parity, theirs)
        out, new_residual = group.call(rank, mine, residual, weight)
        expected_out, expected_residual = _reference([theirs, mine], residual, weight)
        assert torch.equal(new_residual, expected_residual)
        torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
        assert torch.equal(group.buffers[0][parity, rank, :2], mine)
        assert group.states[rank].tolist() == [call + 1, 0]


def test_inputs_are_checked():
    group = Group(2, 32, torch.float32)
    weight = torch.ones(32, device=DEVICE)
    rows = torch.zeros(MAX_ROWS + 1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        group.call(0, rows, rows, weight)
    with pytest.raises(ValueError, match="residual"):
        group.call(0, rows[:2], rows[:3], weight)
    with pytest.raises(ValueError, match="weight"):
        group.call(0, rows[:2], rows[:2], weight[:16])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="two kernels waiting on each other must run at once: CUDA "
                    "streams (the interpreter runs one program at a time)")
def test_two_ranks_exchange_rows_through_each_others_buffers():
    """Two ranks played by two threads on two streams of one GPU, each calling the kernel on its own partials:
    every call waits for the other rank's rows, and consecutive calls (different row counts) use the halves in
    turn. Each rank ends with the same sums."""
    import threading

    world, hidden = 2, 64
    dtype = torch.float32
    group = Group(world, hidden, dtype)
    generator = torch.Generator().manual_seed(5)
    calls = [(rows, [torch.randn(rows, hidden, generator=generator).to(DEVICE) for _ in range(world)],
              torch.randn(rows, hidden, generator=generator).to(DEVICE)) for rows in (3, 1, 4, 2, 4)]
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(DEVICE)
    results: list[list] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())  # the inputs were made on the default stream
            with torch.cuda.stream(stream):
                for _, partials, residual in calls:
                    results[rank].append(group.call(rank, partials[rank], residual, weight))
            stream.synchronize()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    # Both ranks' kernels are loaded first: a module loaded lazily on its first launch waits for the context's
    # running kernels, here the other rank's, which wait for this one (two processes, as in the engine, never
    # share a context).
    for rank in range(world):
        warm = Group(world, hidden, dtype)
        warm.arrive(rank, 1 - rank, 0, calls[0][1][1 - rank])
        warm.call(rank, calls[0][1][rank], calls[0][2], weight)
    torch.cuda.synchronize()
    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting for the other's rows"
    assert not errors, errors
    for (_, partials, residual), *per_rank in zip(calls, *results):
        expected_out, expected_residual = _reference(partials, residual, weight)
        for out, new_residual in per_rank:
            assert torch.equal(new_residual, expected_residual)
            torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    assert [state.tolist() for state in group.states] == [[len(calls), 0]] * world
    assert not any(flag.any() for flag in group.flags)  # every flag raised was lowered by its reader

