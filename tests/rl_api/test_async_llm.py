"""AsyncLLM: asynchronous set-up in a caller's placement group, collective_rpc with a worker extension."""

from __future__ import annotations

import asyncio
import sys

import pytest

from raylm import AsyncLLM, KvCacheConfig, SamplingParams
from tests.conftest import cluster_placement_groups

KV = KvCacheConfig(max_tokens=1024, tokens_per_block=16)


class PlacementProbe:
    """A worker extension: methods mixed into every worker, reached through collective_rpc."""

    def placement_group_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_placement_group_id()

    def num_layers(self) -> int:
        return self.runner.model.num_local_layers

    def scaled(self, value: int, factor: int = 1) -> int:
        return value * factor


@pytest.fixture(scope="module", autouse=True)
def _ship_this_module_by_value(ray_cluster):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _bundle_is_free(group, index: int) -> bool:
    """Whether a one-CPU probe actor can start in the bundle (it cannot when an engine worker holds it)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Probe:
        def ping(self) -> bool:
            return True

    probe = Probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)).remote()
    ready, _ = ray.wait([probe.ping.remote()], timeout=3.0)
    ray.kill(probe)
    return bool(ready)


def test_async_llm_runs_on_exactly_the_given_bundles(ray_cluster, tiny_model_dirs):
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 1}] * 3, strategy="PACK")
    ray_cluster.get(group.ready())

    async def run():
        llm = AsyncLLM(placement_groups=[group], placement_bundle_indices=[[1, 2]], model=str(tiny_model_dirs["llama"]),
                       tensor_parallel_size=2, kv_cache_config=KV, worker_extension_cls=PlacementProbe)
        await llm  # `await AsyncLLM(...)` sets it up
        try:
            where = await llm.collective_rpc("placement_group_id")
            free = [_bundle_is_free(group, index) for index in range(3)]
            layers = await llm.collective_rpc("num_layers", target_ranks=[1])
            scaled = await llm.collective_rpc("scaled", args=(3,), kwargs={"factor": 5}, unique_reply_rank=0)
            output = await llm.generate_async([5, 6, 7, 8], SamplingParams(max_tokens=4))
        finally:
            llm.shutdown()
        return where, free, layers, scaled, output

    where, free, layers, scaled, output = asyncio.run(run())
    assert where == [group.id.hex()] * 2
    # Bundles 1 and 2 hold the engine's workers (their CPU is taken); bundle 0 is untouched.
    assert free == [True, False, False]
    assert layers == [2] and scaled == [15]
    assert len(output.outputs[0].token_ids) == 4
    # The caller's placement group outlives the engine.
    assert [g.state for g in cluster_placement_groups() if g.placement_group_id == group.id.hex()] == ["CREATED"]
    remove_placement_group(group)


def test_two_async_llms_at_once_with_async_with(ray_cluster, tiny_model_dirs):
    async def run():
        async with AsyncLLM(model=str(tiny_model_dirs["llama"]), kv_cache_config=KV) as first, \
                AsyncLLM(model=str(tiny_model_dirs["qwen3"]), tensor_parallel_size=2, kv_cache_config=KV) as second:
            ids = await first.collective_rpc("report_device_id") + await second.collective_rpc("report_device_id")
            outputs = await asyncio.gather(
                first.generate_async([5, 6, 7], SamplingParams(max_tokens=6)),
                second.generate_async([5, 6, 7], SamplingParams(max_tokens=6)),
            )
        return ids, outputs

    ids, outputs = asyncio.run(run())
    assert len(set(ids)) == 3
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_async_llm_must_be_set_up_before_use(tiny_model_dirs):
    llm = AsyncLLM(model=str(tiny_model_dirs["llama"]))
    with pytest.raises(RuntimeError, match="not set up"):
        llm.generate_async([1, 2, 3])
