"""Two GPUs: TP=2 and PP=2 greedy tokens equal one GPU's (and HF's) in fp32 with the default all-reduces (symmetric
memory, fused into the RMSNorm), with each of them alone and with NCCL alone, PP=2 with overlapped steps, and an
AsyncLLM sharing a caller's 2-bundle placement group, GPU by GPU, with another actor. Runs only where 2 CUDA
devices are."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from raylm import LLM, AsyncLLM, KvCacheConfig, SamplingParams, TokensPrompt
from tests.conftest import hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040] * 9, [7, 7, 7],
           list(range(1000, 1100))]
NEW_TOKENS = 32
KV = KvCacheConfig(max_tokens=8192, tokens_per_block=16)
_one_gpu: dict[str, list[list[int]]] = {}


def _greedy(path, **layout) -> list[list[int]]:
    with LLM(str(path), device="cuda", dtype="float32", skip_tokenizer_init=True, kv_cache_config=KV,
             max_seq_len=1024, executor="ray", **layout) as llm:
        assert len(llm.collective_rpc("report_device_id")) == layout.get("tensor_parallel_size", 1) * layout.get(
            "pipeline_parallel_size", 1)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                               SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    ("arch", "layout"),
    [
        ("llama", {"tensor_parallel_size": 2}),
        ("llama", {"tensor_parallel_size": 2, "cuda_graph_config": None}),
        ("llama", {"pipeline_parallel_size": 2}),
        ("qwen2", {"tensor_parallel_size": 2}),
        ("qwen2", {"pipeline_parallel_size": 2}),
        ("qwen3", {"tensor_parallel_size": 2}),
        ("qwen3", {"pipeline_parallel_size": 2}),
        ("qwen3_moe", {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2}),
    ],
)
def test_two_gpu_greedy_tokens_equal_one_gpu_and_hf(ray_cluster, tiny_model_dirs, arch, layout):
    path = tiny_model_dirs[arch]
    if arch not in _one_gpu:
        _one_gpu[arch] = _greedy(path)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
        assert _one_gpu[arch] == [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]
        del hf
        torch.cuda.empty_cache()
    assert _greedy(path, **layout) == _one_gpu[arch]


class PipelineProbe:
    def overlaps_pipeline(self) -> bool:
        return self.engine.overlap and self.engine.scheduler.skip_in_flight


def test_overlapped_pipeline_steps_give_the_same_tokens(ray_cluster, tiny_model_dirs):
    """Overlapped pipeline steps over NCCL: the first stage runs step N+1 while the last finishes step N (their
    activations and logits cross while the other stage computes); a budget of 16 tokens a step chunks the prompts,
    so steps overlap from the first."""
    path = tiny_model_dirs["llama"]
    with LLM(str(path), device="cuda", dtype="float32", skip_tokenizer_init=True, kv_cache_config=KV,
             max_seq_len=1024, pipeline_parallel_size=2, max_num_tokens=16,
             worker_extension_cls=PipelineProbe) as llm:
        assert llm.collective_rpc("overlaps_pipeline", target_ranks=[0]) == [True]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                               SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    if "llama" not in _one_gpu:
        _one_gpu["llama"] = _greedy(path)
    assert [o.outputs[0].token_ids for o in outputs] == _one_gpu["llama"]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster with the machine's GPUs (no dashboard: these tests do not read Ray's state API)."""
    import ray

    ray.init(address="local", num_cpus=8, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _ship_this_module_by_value(ray_cluster):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class AllReduceProbe:
    def all_reduce_paths(self) -> tuple[bool, bool, bool]:
        return self.ctx.fast_all_reduce is not None, self.ctx.defer_reduce, self.ctx.fused_norm is not None


@pytest.mark.parametrize(("symm", "paths"), [(True, (True, False, False)), (False, (False, False, False))],
                         ids=["symmetric-memory-alone", "nccl-alone"])
def test_each_all_reduce_path_gives_the_same_tokens(ray_cluster, tiny_model_dirs, symm, paths):
    """kernel_config.symmetric_memory_allreduce with the fused norm off: small all-reduces go through symmetric
    memory (in the decode graphs too); both off: NCCL carries every all-reduce."""
    path = tiny_model_dirs["llama"]
    kernels = {"symmetric_memory_allreduce": symm, "fused_allreduce_norm": False}
    with LLM(str(path), device="cuda", dtype="float32", skip_tokenizer_init=True, kv_cache_config=KV,
             max_seq_len=1024, tensor_parallel_size=2, kernel_config=kernels,
             worker_extension_cls=AllReduceProbe) as llm:
        assert llm.collective_rpc("all_reduce_paths") == [paths, paths]
        if symm:  # every GPU of the node is visible to these workers; each still computes on its own
            assert sorted(llm.collective_rpc("report_device_id")) == sorted(_gpu_uuids()[:2])
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                               SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False)
    if "llama" not in _one_gpu:
        _one_gpu["llama"] = _greedy(path)
    assert [o.outputs[0].token_ids for o in outputs] == _one_gpu["llama"]


class NormProbe:
    def fused_norm(self) -> bool:
        return self.ctx.defer_reduce and self.ctx.fused_norm is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_all_reduce_norm_gives_the_same_tokens(ray_cluster, tiny_model_dirs, dtype):
    """The default at TP > 1 on GPUs: the o / down projections' all-reduce runs in one kernel with the residual add
    and RMSNorm after it (kernels/triton_allreduce.py), eager and in the decode graphs, next to the symmetric
    all-reduce of the embedding. float32: the tokens of one GPU; bfloat16: the tokens of TP=2 with
    kernel_config.fused_allreduce_norm off (the sum of two bf16 partials rounds once either way)."""
    path = tiny_model_dirs["llama"]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    settings = dict(device="cuda", dtype=dtype, skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=1024,
                    tensor_parallel_size=2)
    if dtype == "bfloat16":
        with LLM(str(path), kernel_config={"fused_allreduce_norm": False}, **settings) as llm:
            expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    else:
        if "llama" not in _one_gpu:
            _one_gpu["llama"] = _greedy(path)
        expected = _one_gpu["llama"]
    with LLM(str(path), worker_extension_cls=NormProbe, **settings) as llm:
        assert llm.collective_rpc("fused_norm") == [True, True]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # the buffers' halves keep alternating
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.outputs[0].token_ids for o in again] == expected


def _gpu_uuids() -> list[str]:
    return [str(torch.cuda.get_device_properties(index).uuid) for index in range(torch.cuda.device_count())]


class MemoryHolder:
    """Another tenant of the GPUs (a trainer's actor, say): holds `gib` GiB on its GPU share."""

    def __init__(self, gib: float):
        self.block = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device="cuda")

    def device_id(self) -> str:
        return str(torch.cuda.get_device_properties(0).uuid)

    def checksum(self) -> float:
        return float(self.block.sum())


def test_async_llm_shares_a_two_bundle_group_with_another_actor(ray_cluster, tiny_model_dirs):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(group.ready())
    holder_cls = ray.remote(MemoryHolder)
    holders = [holder_cls.options(num_cpus=0, num_gpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)).remote(4.0) for index in range(2)]
    holder_ids = ray.get([h.device_id.remote() for h in holders])

    async def run():
        async with AsyncLLM(placement_groups=[group], placement_bundle_indices=[[0, 1]], per_worker_gpu_share=0.5,
                            model=str(tiny_model_dirs["llama"]), tensor_parallel_size=2, device="cuda",
                            skip_tokenizer_init=True,
                            kv_cache_config=KvCacheConfig(max_tokens=8192, free_gpu_memory_fraction=0.2)) as llm:
            ids = await llm.collective_rpc("report_device_id")
            output = await llm.generate_async([5, 6, 7, 8], SamplingParams(max_tokens=8))
        return ids, output

    try:
        ids, output = asyncio.run(run())
        # The engine's two ranks sit on the two GPUs of bundles 0 and 1, in bundle order, next to the holders.
        assert ids == holder_ids and len(set(ids)) == 2
        assert len(output.outputs[0].token_ids) == 8
        assert ray.get([h.checksum.remote() for h in holders]) == [4.0 * 2**30 / 4] * 2
    finally:
        for holder in holders:
            ray.kill(holder)
        remove_placement_group(group)
