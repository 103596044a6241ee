"""Where a decode step's time goes: host time per engine phase (schedule, plan, forward launch, logits,
sampling, progress) measured on the engine thread, the GPU time of the decode forward alone (CUDA events
around graph replays), and the GPU busy fraction over a whole generate call; with --gaps N, where the GPU sits idle:
the N pairs of neighbouring GPU activities (kernel, copy) with the most idle time between them.

    python benchmarks/step_profile.py --model benchmarks/configs/smollm2-135m --load_format dummy --batch_size 1
    python benchmarks/step_profile.py --model benchmarks/configs/llama-3.1-8b --load_format dummy --batch_size 8

With --tp or --pp above 1 the engine runs in Ray worker actors, out of this process's reach: the profile is then
taken inside the workers through collective_rpc (a worker extension): each rank's host time per phase over one
generate call without the CUDA profiler (rank 0 hosts the engine; the other ranks wait for each step's plan,
then launch their share), then each rank's device kernels over another (time per step, calls, the busy
fraction), which shows what the collectives cost beside the layers.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import add_model_args, build_llm, random_prompts, run_suffix, write_result  # noqa: E402

STEP = "step (all)"
WORKER_WAIT = "plan broadcast (others wait)"


def wrap_engine_phases(timer: PhaseTimer, engine, runner) -> None:
    """The engine's own phases of a step, on the process that hosts it (the runner's are wrapped apart)."""
    timer.wrap(engine, "step", STEP)
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.progress, "apply", "progress")
    timer.wrap(engine.progress, "launched", "launch bookkeeping")
    timer.wrap(engine, "_stats", "stats")
    timer.wrap(runner, "feed_tokens", "feed tokens (index)")


def wrap_runner_phases(timer: PhaseTimer, runner) -> None:
    """The model runner's phases of a step, on every rank."""
    timer.wrap(runner, "forward", "forward launch")
    timer.wrap(runner, "compute_outputs", "logits")
    timer.wrap(runner, "_draw", "sample (queued)")
    timer.wrap(runner, "collect", "collect (waits for the device)")


class PhaseTimer:
    """Wraps methods so that each call's host time is added to its phase."""

    def __init__(self):
        self.totals: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase].append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def summary(self, steps: int) -> dict[str, float]:
        """ms per step of each phase; with "step (all)" (the engine's step, around every other phase timed)
        also the rest of the step's host time, in no phase."""
        phases = {phase: 1000 * sum(values) / steps for phase, values in self.totals.items()}
        if STEP in phases:
            phases["other host work in the step"] = phases[STEP] - sum(
                ms for phase, ms in phases.items() if phase not in (STEP, WORKER_WAIT))
        return phases


def print_phases(phases: dict[str, float]) -> None:
    for phase, ms in phases.items():
        print(f"  {phase:<34}{ms:8.3f} ms/step")


class KernelProfile:
    """Worker extension: this rank's host time per phase, and the CUDA kernels its GPU ran, between two
    collective_rpc calls (the profiler records kernels of every thread of the process, the engine's included)."""

    def start_phase_timer(self) -> None:
        """Times this rank's phases from now on (rank 0: the engine's; others: the worker loop's)."""
        from raylm.actors import distributed

        timer = self._phase_timer = PhaseTimer()
        engine = getattr(self, "engine", None)
        if engine is not None:  # rank 0 hosts the engine
            wrap_engine_phases(timer, engine, self.runner)
        else:
            timer.wrap(self.runner, "graph_feed", "feed tokens (own graph)")
        # Wrapped on the module and the class: the distributed runner and the worker loop look them up per call.
        timer.wrap(distributed, "plan_step", "plan")
        timer.wrap(distributed.Communicator, "broadcast_plans", "plan broadcast (others wait)")
        timer.wrap(distributed.Communicator, "broadcast_feed", "feed broadcast (queued)")
        wrap_runner_phases(timer, self.runner)

    def stop_phase_timer(self) -> dict:
        """Host ms per step of each phase since start_phase_timer, and the steps (rank 0: engine steps; others:
        plans received, the last of which stops nothing here)."""
        totals = self._phase_timer.totals
        steps = len(totals.get(STEP) or totals.get(WORKER_WAIT) or [None])
        return {"steps": steps, "host_ms_per_step": self._phase_timer.summary(steps)}

    def start_kernel_profile(self) -> None:
        self._kernel_profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self._kernel_profile.__enter__()

    def stop_kernel_profile(self, top: int, steps: int = 1, gaps: int = 0) -> dict:
        """Total kernel time (us), the `top` kernels: (name, calls, total us), and with `gaps` the idle
        analysis over `steps` steps (idle_gaps)."""
        torch.cuda.synchronize(self.device)
        self._kernel_profile.__exit__(None, None, None)
        averages = self._kernel_profile.key_averages()
        idle = idle_gaps(gpu_activities(self._kernel_profile), steps, gaps) if gaps else None
        del self._kernel_profile
        ranked = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)
        return {"busy_us": sum(e.self_device_time_total for e in averages),
                "top": [(e.key, e.count, e.self_device_time_total) for e in ranked[:top]], "idle": idle}


def short_kernel_name(name: str) -> str:
    """A kernel's name without its template and argument lists."""
    return name.split("<")[0].split("(")[0].strip()[:60] or name[:60]


def idle_gaps(activities: list[tuple[str, float, float]], steps: int, top: int) -> dict:
    """Idle time of a GPU over a timeline of (name, start µs, end µs) activities: the total per step and the
    `top` (before, after) pairs of neighbouring activities with the most idle time between them, per step. An
    activity that overlaps the ones before it (under programmatic dependent launch, or on another stream) idles
    nothing; 'before' is the activity that ended last before the gap."""
    timeline = sorted(activities, key=lambda activity: activity[1])
    if not timeline:
        return {"idle_us_per_step": 0.0, "gaps": []}
    pairs: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0.0, 0])
    idle = 0.0
    last_name, last_end = timeline[0][0], timeline[0][2]
    for name, start, end in timeline[1:]:
        if start > last_end:
            pair = pairs[(short_kernel_name(last_name), short_kernel_name(name))]
            pair[0] += start - last_end
            pair[1] += 1
            idle += start - last_end
        if end > last_end:
            last_name, last_end = name, end
    worst = sorted(pairs.items(), key=lambda item: item[1][0], reverse=True)[:top]
    return {"idle_us_per_step": idle / steps,
            "gaps": [{"before": before, "after": after, "us_per_step": us / steps, "per_step": count / steps}
                     for (before, after), (us, count) in worst]}


def print_gaps(idle: dict | None) -> None:
    if idle is not None:
        print(f"  GPU idle {idle['idle_us_per_step']:.1f} us/step; the most between:")
        for gap in idle["gaps"]:
            print(f"  idle {gap['us_per_step']:7.1f} us/step {gap['per_step']:6.1f}x  "
                  f"{gap['before']} -> {gap['after']}")


def gpu_activities(profiler) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every kernel, copy and memset the profiler saw on the GPU."""
    return [(event.name, event.time_range.start, event.time_range.end) for event in profiler.events()
            if event.device_type == torch.autograd.DeviceType.CUDA]


def warmed_up_workload(args: argparse.Namespace, llm, lora_requests=None) -> tuple[list, object]:
    """The profiled call's prompts and sampling parameters, after one warm-up generate call with them (and with
    lora_requests, one per prompt, which the warm-up loads)."""
    from raylm import SamplingParams, TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in random_prompts(args.batch_size, args.input_len, llm.info.vocab_size, args.seed)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    return prompts, params


def random_adapters(args: argparse.Namespace, directory: Path) -> list:
    """--lora_rank: a random rank-R adapter of its own for each request of the batch (benchmarks/lora.py's)."""
    from benchmarks.lora import write_random_adapter
    from raylm import LoRARequest
    from raylm.models.loader import load_hf_config
    from raylm.models.source import resolve_model

    hf_config = load_hf_config(resolve_model(args.model), False)
    requests = []
    for index in range(args.batch_size):
        write_random_adapter(directory / f"adapter-{index}", hf_config, args.lora_rank, seed=index)
        requests.append(LoRARequest(f"adapter-{index}", index + 1, str(directory / f"adapter-{index}")))
    return requests


def profile_ranks(args: argparse.Namespace) -> None:
    """The multi-rank profile: per-rank host phases over one generate call, then on GPUs per-rank kernel tables
    over another (see the module's docstring)."""
    llm = build_llm(args, max_seq_len=args.input_len + args.output_len + 16, worker_extension_cls=KernelProfile)
    device = llm.info.device
    prompts, params = warmed_up_workload(args, llm)
    llm.collective_rpc("start_phase_timer")
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    host_wall = time.perf_counter() - start
    hosts = llm.collective_rpc("stop_phase_timer")
    steps = args.output_len  # one prefill step, then a decode step per token after the first
    result = {"steps": steps, "unprofiled_ms_per_step": 1000 * host_wall / steps,
              "ranks": [{"host_ms_per_step": host["host_ms_per_step"], "host_steps": host["steps"]} for host in hosts]}
    if device == "cuda":
        llm.collective_rpc("start_kernel_profile")
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        kernels = llm.collective_rpc("stop_kernel_profile", (max(args.kernels, 12), steps, args.gaps))
        result.update(wall_s=wall, ms_per_step=1000 * wall / steps)
        for entry, rank in zip(result["ranks"], kernels):
            entry.update(busy_fraction=rank["busy_us"] / 1e6 / wall, idle=rank["idle"],
                         top_kernels=[{"name": name, "calls": calls, "ms_per_step": us / 1000 / steps}
                                      for name, calls, us in rank["top"]])
    llm.shutdown()
    name = f"step-profile-{Path(args.model or 'smollm2').name}-b{args.batch_size}-{device}{run_suffix(args)}"
    path = write_result(name, args, result)
    print(f"{steps} steps, {result['unprofiled_ms_per_step']:.3f} ms per step (wall) timing host phases"
          + (f", {result['ms_per_step']:.3f} under the CUDA profiler" if "ms_per_step" in result else ""))
    for rank, entry in enumerate(result["ranks"]):
        print(f"rank {rank}: host, without the CUDA profiler ({entry['host_steps']} steps):")
        print_phases(entry["host_ms_per_step"])
        if "busy_fraction" in entry:
            print(f"rank {rank}: device busy {100 * entry['busy_fraction']:.0f}%")
            for kernel in entry["top_kernels"]:
                print(f"  {kernel['ms_per_step']:8.3f} ms/step {kernel['calls']:7d} calls  {kernel['name'][:90]}")
            print_gaps(entry["idle"])
    print(f"wrote {path}")


def decode_gpu_ms(runner, batch: int, context: int, iters: int = 50) -> float | None:
    """GPU time of one graphed decode forward of `batch` sequences at `context` tokens (with the logits, which the
    graph computes on the last stage)."""
    graphs = runner.graphs
    blocks_per_seq = -(-context // runner.block_size)
    if graphs is None or runner.device.type != "cuda" or not graphs.fits(batch, blocks_per_seq):
        return None
    contexts = [(list(range(1, blocks_per_seq + 1)), context)] * batch
    args = ([1] * batch, [context - 1] * batch, [-1] * batch, contexts)
    graphs.run_step(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graphs.run_step(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, peer=False)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--input_len", type=int, default=32)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also print the N GPU kernels with the most time over the profiled generate call")
    parser.add_argument("--gaps", type=int, default=0, metavar="N",
                        help="also print the N pairs of neighbouring GPU activities with the most idle time between")
    parser.add_argument("--lora_rank", type=int, default=0, metavar="R",
                        help="each request with a random rank-R LoRA adapter of its own (one process only)")
    args = parser.parse_args()
    if args.tp * args.pp > 1:
        profile_ranks(args)
        return

    from raylm import LoraConfig
    from raylm.engine import model_runner

    lora_requests, extra = None, {}
    if args.lora_rank:
        scratch = tempfile.TemporaryDirectory()
        lora_requests = random_adapters(args, Path(scratch.name))
        extra["lora_config"] = LoraConfig(max_loras=args.batch_size, max_lora_rank=args.lora_rank)
    llm = build_llm(args, max_seq_len=args.input_len + args.output_len + 16, executor="local", **extra)
    worker = llm._executor.worker
    engine, runner = worker.engine, worker.runner
    prompts, params = warmed_up_workload(args, llm, lora_requests)

    timer = PhaseTimer()
    wrap_engine_phases(timer, engine, runner)
    timer.wrap(model_runner, "plan_step", "plan")
    wrap_runner_phases(timer, runner)
    cuda = runner.device.type == "cuda"
    profiler = None
    if cuda:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        profiler.__enter__()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    wall = time.perf_counter() - start
    gpu_busy, top_kernels, gaps = None, [], None
    if profiler is not None:
        torch.cuda.synchronize()
        profiler.__exit__(None, None, None)
        averages = profiler.key_averages()
        kernel_us = sum(e.self_device_time_total for e in averages)
        gpu_busy = kernel_us / 1e6 / wall
        top_kernels = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:args.kernels]
    steps = len(timer.totals["step (all)"])
    if profiler is not None and args.gaps:
        gaps = idle_gaps(gpu_activities(profiler), steps, args.gaps)
    phases = timer.summary(steps)
    result = {
        "steps": steps, "wall_s": wall, "ms_per_step": 1000 * wall / steps, "host_ms_per_step": phases,
        "gpu_busy_fraction": gpu_busy,
        "decode_forward_gpu_ms": decode_gpu_ms(runner, args.batch_size, args.input_len + args.output_len // 2),
        "engine_step_median_ms": 1000 * statistics.median(timer.totals["step (all)"]),
        "top_kernels": [{"name": e.key, "calls": e.count, "ms_per_step": e.self_device_time_total / 1000 / steps}
                        for e in top_kernels],
        "idle": gaps,
    }
    llm.shutdown()
    lora = f"-lora-r{args.lora_rank}" if args.lora_rank else ""
    name = (f"step-profile-{Path(args.model or 'smollm2').name}-b{args.batch_size}{lora}-{llm.info.device}"
            f"{run_suffix(args)}")
    path = write_result(name, args, result)
    print(f"{steps} steps, {result['ms_per_step']:.3f} ms per step (wall), GPU busy "
          f"{gpu_busy if gpu_busy is None else f'{100 * gpu_busy:.0f}%'}, decode forward on the GPU "
          f"{result['decode_forward_gpu_ms']} ms")
    print_phases(phases)
    for kernel in result["top_kernels"]:
        print(f"  GPU {kernel['ms_per_step']:8.3f} ms/step {kernel['calls']:7d} calls  {kernel['name'][:90]}")
    print_gaps(gaps)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
