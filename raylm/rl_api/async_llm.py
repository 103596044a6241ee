"""AsyncLLM: an LLM set up asynchronously on Ray workers, for RL loops and agents.

    llm = await AsyncLLM(model=..., placement_groups=[pg], placement_bundle_indices=[[1, 2]],
                         tensor_parallel_size=2)
    out = await llm.generate_async(prompt, SamplingParams(...))
    ids = await llm.collective_rpc("report_device_id")

Construction only records the arguments; `await llm`, `async with llm` or `await llm.setup_async()`
starts the engine without blocking the event loop. Workers run as Ray actors unless executor="local".

An RL step: `await llm.pause_generation()`, `await llm.update_weights({device_id: handles})` (any number of
calls), `await llm.update_weights(None)` (finalize: a new weight version), `await llm.resume_generation()`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from raylm.engine.device_memory import check_tags
from raylm.llm import LLM
from raylm.lora_request import LoRARequest

PAUSE_MODES = ("abort", "keep")
# Memory tags a step needs on the device (without cuda_graph, decode steps run eagerly).
_NEEDED_TO_GENERATE = ("model_weights", "kv_cache", "model")
# How long pause_generation(mode="abort") waits for the aborted requests' last outputs to reach their callers.
_ABORT_DELIVERY_S = 60.0


class MemoryReleasedError(ValueError):
    """A call refused because it needs device memory that release() freed, until resume() brings it back."""


class AsyncLLM(LLM):
    def __init__(
        self,
        placement_groups: list[Any] | None = None,
        placement_bundle_indices: list[list[int]] | None = None,
        per_worker_gpu_share: float | None = None,
        *args: Any,
        **kwargs: Any,
    ):
        kwargs.setdefault("executor", "ray")
        self._init_args = args
        self._init_kwargs = dict(kwargs, placement_groups=placement_groups,
                                 placement_bundle_indices=placement_bundle_indices,
                                 per_worker_gpu_share=per_worker_gpu_share)
        self._client = None
        self._ready = False
        self._paused = False
        self._released: set[str] = set()
        self.weight_version = 0
        self._setup_lock: asyncio.Lock | None = None

    async def setup_async(self) -> AsyncLLM:
        """Starts the engine (loads the model on its workers); safe to call more than once."""
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        async with self._setup_lock:
            if not self._ready:
                await asyncio.to_thread(LLM.__init__, self, *self._init_args, **self._init_kwargs)
                self._ready = True
        return self

    def __await__(self):
        return self.setup_async().__await__()

    async def __aenter__(self) -> AsyncLLM:
        return await self.setup_async()

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def _require_ready(self) -> None:
        if not self._ready:
            raise RuntimeError("AsyncLLM is not set up: await it, use 'async with', or await setup_async()")

    def _require_generating(self) -> None:
        self._require_ready()
        missing = [tag for tag in _NEEDED_TO_GENERATE if tag in self._released]
        if missing:
            raise MemoryReleasedError(f"generation needs {missing} on the device: await resume({missing}) first")

    def generate_async(self, *args: Any, **kwargs: Any):
        self._require_generating()
        return super().generate_async(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any):
        self._require_generating()
        return super().generate(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any):
        """LLM.encode (spec: blocking); encode_async returns an awaitable result for one prompt."""
        self._require_generating()
        return super().encode(*args, **kwargs)

    def encode_async(self, *args: Any, **kwargs: Any):
        self._require_generating()
        return super().encode_async(*args, **kwargs)

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             unique_reply_rank: int | None = None,
                             target_ranks: int | list[int] | None = None) -> list[Any]:
        """Runs a worker method (or a worker_extension_cls method) on the workers; one result per rank."""
        self._require_ready()
        return await asyncio.to_thread(super().collective_rpc, method, args, kwargs, unique_reply_rank,
                                       target_ranks)

    # ------------------------------------------------------------------ LoRA adapters

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """LLM.add_lora: loads an adapter (its path, or in memory: peft_config and lora_tensors, as a trainer hands
        over the one it trained) on every worker; False when the id already holds it."""
        self._require_ready()
        return await asyncio.to_thread(super().add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """LLM.remove_lora: frees the adapter's id, slot and worker copies (refused while requests use it)."""
        self._require_ready()
        return await asyncio.to_thread(super().remove_lora, lora_int_id)

    async def list_loras(self) -> list[LoRARequest]:
        self._require_ready()
        return super().list_loras()

    # ------------------------------------------------------------------ RL control

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stops generating until resume_generation(); requests that arrive meanwhile wait. mode="abort" ends every
        request now (finish_reason "abort", stop_reason "generation paused", its KV blocks freed) and returns once
        their outputs are delivered; mode="keep" parks running requests, which go on after resume with the
        weights then in place (their outputs' weight_versions say which tokens each version produced)."""
        self._require_ready()
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        pending = self._client.unfinished_ids()
        await asyncio.to_thread(self._executor.engine_call, "pause", (mode == "abort",))
        self._paused = True
        if mode == "abort":
            await asyncio.to_thread(self._client.wait_finished, pending, _ABORT_DELIVERY_S)

    async def resume_generation(self) -> None:
        """Lets the engine run requests again after pause_generation()."""
        self._require_generating()
        await asyncio.to_thread(self._executor.engine_call, "resume_generation", ())
        self._paused = False

    async def update_weights(self, weights: dict | None) -> None:
        """New weights: `weights` maps each worker's device id (collective_rpc("report_device_id")) to its tensors
        under checkpoint (HF) names, as rl_api/weight_transfer.py hands them over (IPC handles, buckets, or a
        base64 string of either). Any subset of the weights; every tensor is checked (name, full shape, dtype)
        before any is copied, so a bad update raises and leaves the old weights serving. None finalizes: outputs
        from then on carry the next weight_version, and no request admitted after it reuses KV cached before.
        Needs generation paused while requests run (pause_generation); otherwise the engine is paused around it."""
        await self._while_paused("update_weights", (weights,))
        if weights is None:
            self.weight_version = await asyncio.to_thread(self._executor.engine_call, "new_weight_version", ())

    async def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                       world_size: int, backend: str = "nccl", timeout_s: float = 60.0) -> None:
        """Joins a trainer's process group for weight broadcasts (actors/weight_group.py): the trainer is rank 0
        and hosts its TCPStore at master_address:master_port; engine rank r is rank_offset + r of world_size.
        The trainer creates its side at the same time; raises TimeoutError when it has not come by timeout_s."""
        self._require_ready()
        await asyncio.to_thread(self._executor.collective_rpc, "init_weight_update_group",
                                (master_address, master_port, rank_offset, world_size, backend, timeout_s))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list) -> None:
        """Receives the tensors the trainer broadcasts from rank 0 of the weight-update group, one per name in
        this order (dtypes: torch dtypes or their names; shapes: full, unsharded). Checked as update_weights
        checks them before any is received; update_weights(None) finalizes as after update_weights."""
        await self._while_paused("update_weights_from_distributed", (list(names), list(dtypes), list(shapes)))

    async def destroy_weight_update_group(self) -> None:
        self._require_ready()
        await asyncio.to_thread(self._executor.collective_rpc, "destroy_weight_update_group")

    async def release(self, tags: list[str]) -> None:
        """Frees the device memory of `tags` on every rank (engine/device_memory.py: model_weights, kv_cache,
        cuda_graph, model), after the step in flight. Needs generation paused while requests run; releasing the
        KV cache sends parked requests back to be computed again after resume. Releasing a released tag does
        nothing."""
        tags = check_tags(tags)
        self._require_ready()
        if not self._paused and self._client.num_unfinished:
            raise ValueError("release while requests run: call pause_generation() first")
        if "kv_cache" in tags and "kv_cache" not in self._released:
            await asyncio.to_thread(self._executor.engine_call, "forget_kv", ())
        await self._while_paused("release_memory", (tags,))
        self._released.update(tags)

    async def resume(self, tags: list[str]) -> None:
        """Brings the memory of `tags` back on every rank (weights from their host copy unless sleep_config
        discards them; the KV cache empty; the decode graphs captured again once weights and cache are back)."""
        tags = check_tags(tags)
        self._require_ready()
        await self._while_paused("resume_memory", (tags,))
        self._released.difference_update(tags)

    async def get_memory_status(self) -> list[dict]:
        """Per rank: bytes per tag and whether each is resident; on GPUs the device's free and total bytes."""
        self._require_ready()
        return await asyncio.to_thread(self._executor.collective_rpc, "memory_status")

    async def _while_paused(self, method: str, args: tuple) -> None:
        """A worker method on every rank while no step runs: generation paused by the caller, or (nothing
        running) paused around the call."""
        self._require_ready()
        if self._paused:
            await asyncio.to_thread(self._executor.collective_rpc, method, args)
            return
        if self._client.num_unfinished:
            raise ValueError(f"{method} while requests run: call pause_generation() first")
        await asyncio.to_thread(self._executor.engine_call, "pause", (False,))
        try:
            await asyncio.to_thread(self._executor.collective_rpc, method, args)
        finally:
            await asyncio.to_thread(self._executor.engine_call, "resume_generation", ())

    def shutdown(self) -> None:
        if getattr(self, "_ready", False):
            super().shutdown()
            self._ready = False
