"""AsyncLLM: an LLM set up asynchronously on Ray workers, for RL loops and agents.

    llm = await AsyncLLM(model=..., placement_groups=[pg], placement_bundle_indices=[[1, 2]],
                         tensor_parallel_size=2)
    out = await llm.generate_async(prompt, SamplingParams(...))
    ids = await llm.collective_rpc("report_device_id")

Construction only records the arguments; `await llm`, `async with llm` or `await llm.setup_async()`
starts the engine without blocking the event loop. Workers always run as Ray actors.
"""

from __future__ import annotations

import asyncio
from typing import Any

from raylm.llm import LLM


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

    def generate_async(self, *args: Any, **kwargs: Any):
        self._require_ready()
        return super().generate_async(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any):
        self._require_ready()
        return super().generate(*args, **kwargs)

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             unique_reply_rank: int | None = None,
                             target_ranks: int | list[int] | None = None) -> list[Any]:
        """Runs a worker method (or a worker_extension_cls method) on the workers; one result per rank."""
        self._require_ready()
        return await asyncio.to_thread(super().collective_rpc, method, args, kwargs, unique_reply_rank,
                                       target_ranks)

    def shutdown(self) -> None:
        if getattr(self, "_ready", False):
            super().shutdown()
            self._ready = False
