"""The Ray executor: tp x pp worker actors in placement-group bundles, rank 0 hosting the engine.

The engine channel costs one Ray call per submission batch and, for the outputs, one streaming generator for the
engine's life whose every item is the iterations since the last: never a call per token. Every worker's loop is
watched: when an actor dies, pending requests fail at once (the driver sees the loop's reference resolve) instead
of waiting on a collective that will never end.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

from raylm.actors.executor import Executor
from raylm.actors.ray_worker import ALL_GPUS_VISIBLE, CONCURRENCY_GROUPS, RayWorker
from raylm.actors.symmetric_memory import symmetric_memory_requested
from raylm.actors.transport import RankLayout
from raylm.engine.messages import EngineRequest, StepOutput
from raylm.engine_spec import WorkerSpec
from raylm.placement import resolve_placement

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 10.0
_CHECK_INTERVAL_S = 0.5  # how often get_output looks for a worker whose loop has ended


def ensure_ray(num_cpus_hint: int, logging_level: int = logging.INFO) -> float:
    """Connects to the Ray cluster (RAY_ADDRESS, or one already running in this process) or starts a local
    one, its driver-side logs at logging_level; returns the seconds it took."""
    import ray

    begin = time.perf_counter()
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": True, "logging_level": logging_level}
        if address:
            kwargs["address"] = address
        else:
            # "local": a cluster of this process's own, not another driver's that ray.init would otherwise join.
            # A CPU worker takes one logical CPU: declare enough for every rank even on a small machine.
            kwargs.update(address="local", num_cpus=max(os.cpu_count() or 1, num_cpus_hint, 8),
                          include_dashboard=False)
        _init_ray_for_the_process(kwargs)
    return time.perf_counter() - begin


def _init_ray_for_the_process(kwargs: dict[str, Any]) -> None:
    """ray.init, made so that the local cluster it may start lives as long as this process.

    Ray ties the processes of a local cluster to the thread that started them (PR_SET_PDEATHSIG): started from
    a worker thread (AsyncLLM's setup runs in asyncio's default executor, whose threads end with asyncio.run),
    the cluster died with that thread and the driver hung on it, past its last line. Off the main thread, Ray
    starts on a daemon thread that stays alive until the process ends.
    """
    import ray

    if threading.current_thread() is threading.main_thread():
        ray.init(**kwargs)
        return
    started: Future[None] = Future()

    def start_and_stay() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        threading.Event().wait()

    threading.Thread(target=start_and_stay, name="raylm-ray-owner", daemon=True).start()
    started.result()


def ray_cluster_is_up() -> bool:
    """True when this process is connected to Ray or RAY_ADDRESS names a cluster."""
    if os.environ.get("RAY_ADDRESS"):
        return True
    try:
        import ray

        return ray.is_initialized()
    except ImportError:
        return False


class RayExecutor(Executor):
    def __init__(self, spec: WorkerSpec, layout: RankLayout, placement_groups: list | None = None,
                 placement_bundle_indices: list[list[int]] | None = None, per_worker_gpu_share: float | None = None,
                 worker_extension_cls: type | str | None = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.layout = layout
        self.timings: dict[str, float] = {"ray_init_seconds": ensure_ray(layout.world_size + 1)}
        begin = time.perf_counter()
        use_gpu = spec.device == "cuda"
        self.placement = resolve_placement(layout.world_size, use_gpu, placement_groups, placement_bundle_indices,
                                           per_worker_gpu_share)
        remote_cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RayWorker)
        self.actors = []
        self._loop_refs: list = []
        self._pending: deque[StepOutput] = deque()
        self._outputs = None  # rank 0's output stream (RayWorker.stream_outputs), an ObjectRefGenerator
        self._dead: str | None = None
        self._next_check = 0.0  # time.monotonic() of get_output's next look for a dead worker
        settings = {}
        if layout.tp > 1 and symmetric_memory_requested(spec.args.kernel_config, spec.device):
            settings[ALL_GPUS_VISIBLE] = "1"  # symmetric-memory rendezvous needs distinct device indices
        try:
            for rank, (group, bundle) in enumerate(self.placement.bundles):
                strategy = PlacementGroupSchedulingStrategy(placement_group=group,
                                                            placement_group_bundle_index=bundle)
                options = dict(num_cpus=0 if use_gpu else 1, num_gpus=self.placement.gpu_share,
                               scheduling_strategy=strategy, name=None)
                if settings:
                    options["runtime_env"] = {"env_vars": settings}
                self.actors.append(remote_cls.options(**options).remote(spec, rank, layout, worker_extension_cls))
            address, port = ray.get(self.actors[0].node_address.remote())
            ray.get([actor.init_distributed.remote(address, port) for actor in self.actors])
            num_blocks = min(ray.get([actor.load_model.remote() for actor in self.actors]))
            infos = ray.get([actor.init_cache.remote(num_blocks) for actor in self.actors])
            self._loop_refs = [actor.run_worker_loop.options(concurrency_group="loop").remote()
                               for actor in self.actors[1:]]
            timings = ray.get(self.actors[0].start_engine.remote(num_blocks))
            self._loop_refs.insert(0, self.actors[0].watch_engine.options(concurrency_group="loop").remote())
            self._outputs = self.actors[0].stream_outputs.options(concurrency_group="outputs",
                                                                  num_returns="streaming").remote()
        except BaseException:
            self._kill()
            raise
        self.timings["worker_start_seconds"] = time.perf_counter() - begin
        self.info = infos[0]
        self.info.startup_metrics = {**timings, "ray_executor": dict(self.timings)}

    @property
    def rank0(self):
        return self.actors[0]

    # ------------------------------------------------------------------ engine channel

    def submit(self, requests: list[EngineRequest]) -> None:
        self.rank0.submit.options(concurrency_group="control").remote(requests)

    def abort(self, request_ids: list[str]) -> None:
        self.rank0.abort.options(concurrency_group="control").remote(request_ids)

    def stop_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.rank0.stop_sequences.options(concurrency_group="control").remote(sequences)

    def get_output(self, timeout: float) -> StepOutput | None:
        import ray

        if self._pending:
            return self._pending.popleft()
        if self._dead is None and time.monotonic() >= self._next_check:
            # A worker's death is looked for at most every _CHECK_INTERVAL_S: the look (ray.wait) costs as much
            # host time as taking a batch of outputs, and a rank 0 that died ends the output stream at once anyway.
            self._next_check = time.monotonic() + _CHECK_INTERVAL_S
            self._dead = self._check_workers()
        if self._dead is not None:
            return StepOutput(fatal_error=self._dead)
        try:
            ready, _ = ray.wait([self._outputs], timeout=timeout)
            if not ready:
                return None
            batch = ray.get(next(self._outputs))
        except StopIteration:  # the stream ends only when the engine stopped
            self._dead = "engine worker 0 stopped"
            return StepOutput(fatal_error=self._dead)
        except Exception as exc:  # rank 0 is gone
            self._dead = f"engine worker 0 failed: {type(exc).__name__}: {exc}"
            return StepOutput(fatal_error=self._dead)
        self._pending.extend(batch)
        return self._pending.popleft() if self._pending else None

    def _check_workers(self) -> str | None:
        """A description of the first worker whose loop has ended, or None while all run."""
        import ray

        done, _ = ray.wait(self._loop_refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self._loop_refs.index(done[0])
        try:
            ray.get(done[0])
            return f"engine worker {rank} stopped"
        except Exception as exc:
            return f"engine worker {rank} died: {type(exc).__name__}: {str(exc).splitlines()[0]}"

    def is_healthy(self) -> bool:
        if self._dead is None:
            self._dead = self._check_workers()
        return self._dead is None

    # ------------------------------------------------------------------ RPC and shutdown

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       target_ranks: list[int] | None = None) -> list[Any]:
        import ray

        ranks = list(range(len(self.actors))) if target_ranks is None else target_ranks
        for rank in ranks:
            if not 0 <= rank < len(self.actors):
                raise ValueError(f"target_ranks must be within [0, {len(self.actors) - 1}], got {rank}")
        return ray.get([self.actors[rank].execute_method.remote(method, tuple(args), dict(kwargs or {}))
                        for rank in ranks])

    def engine_call(self, method: str, args: tuple = ()) -> Any:
        import ray

        return ray.get(self.rank0.engine_call.remote(method, tuple(args)))

    def shutdown(self) -> None:
        import ray

        if not self.actors:
            return
        if not ray.is_initialized():  # Ray shut down first: the workers ended with it
            self.actors = []
            return
        if self._dead is None:
            try:
                ray.get(self.rank0.stop.remote(), timeout=_SHUTDOWN_GRACE_S)
            except Exception:
                logger.warning("engine workers did not stop in time; killing them")
        self._kill()

    def _kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        self.placement.remove_owned()
