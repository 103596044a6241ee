"""The RL loop on AsyncLLM: pause_generation (abort / keep), update_weights from tensor handles (full, partial,
bucketed, base64) finalized into a new weight version, mixture-of-experts weights stacked or per expert, and the
prefix cache across an update. The engine runs in this process (executor="local"); the tensor-parallel cases over
Ray are at the end."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from raylm import AsyncLLM, KvCacheConfig, SamplingParams, TokensPrompt
from raylm.rl_api.weight_transfer import encode_payload, pack_bucket, tensor_handle
from tests.conftest import hf_greedy, hf_model, logprob_errors, per_expert, perturbed_hf_model

KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16)
PROMPTS = [[5, 17, 99, 3, 250, 7, 42, 8], [300, 12, 9, 77, 101, 64, 2048, 11, 5, 6]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)


def _engine(path, **kwargs) -> AsyncLLM:
    return AsyncLLM(model=str(path), executor="local", skip_tokenizer_init=True, kv_cache_config=KV,
                    max_seq_len=512, **kwargs)


async def _generate(llm: AsyncLLM, params: SamplingParams = GREEDY):
    return await asyncio.gather(*(llm.generate_async(TokensPrompt(prompt_token_ids=p), params) for p in PROMPTS))


def _assert_matches_hf(hf, outputs) -> None:
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        generated, _ = logprob_errors(hf, prompt, output)
        assert max(generated) < 1e-4


async def _device_id(llm: AsyncLLM) -> str:
    return (await llm.collective_rpc("report_device_id"))[0]


@pytest.mark.parametrize("form", ["handles", "bucket", "base64-bucket", "partial"])
def test_updated_weights_give_hf_tokens_and_logprobs_of_the_same_weights(tiny_model_dirs, form):
    path = tiny_model_dirs["llama"]
    names = {"model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"} \
        if form == "partial" else None
    hf, weights = perturbed_hf_model(path, names)

    async def run():
        async with _engine(path) as llm:
            before = await _generate(llm)
            device = await _device_id(llm)
            if form == "handles" or form == "partial":
                value = [(name, tensor_handle(tensor)) for name, tensor in weights]
            elif form == "bucket":
                value = pack_bucket(weights).payload()
            else:
                value = encode_payload(pack_bucket(weights).payload())
            await llm.pause_generation()
            await llm.update_weights({device: value})
            await llm.update_weights(None)
            await llm.resume_generation()
            return before, await _generate(llm), llm.weight_version

    before, after, version = asyncio.run(run())
    _assert_matches_hf(hf_model(path), before)
    _assert_matches_hf(hf, after)
    assert version == 1
    assert all(output.weight_version == 0 for output in before)
    assert all(output.weight_version == 1 and output.outputs[0].weight_versions == [(0, 1)] for output in after)


def test_bad_updates_raise_and_leave_the_old_weights_serving(tiny_model_dirs):
    """An unknown name, a wrong shape or a wrong dtype among good tensors: nothing is copied."""
    path = tiny_model_dirs["llama"]
    _, weights = perturbed_hf_model(path)
    good = weights[:3]
    bad_updates = {
        "is not a weight": good + [("model.layers.9.mlp.up_proj.weight", torch.zeros(4))],
        "has shape": good + [(weights[4][0], torch.zeros(3, 3))],
        "the engine's weights are": good + [(weights[4][0], weights[4][1].to(torch.bfloat16))],
    }

    async def run():
        async with _engine(path) as llm:
            device = await _device_id(llm)
            for message, update in bad_updates.items():
                with pytest.raises(ValueError, match=message):
                    await llm.update_weights({device: [(name, tensor_handle(t)) for name, t in update]})
            with pytest.raises(ValueError, match="device"):
                await llm.update_weights({"another-device": []})
            return await _generate(llm)

    _assert_matches_hf(hf_model(path), asyncio.run(run()))


def test_kv_cached_before_an_update_is_not_reused_after_it_but_shared_again(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    prompt = TokensPrompt(prompt_token_ids=list(range(100, 164)))  # 4 full blocks
    params = SamplingParams(max_tokens=2)

    async def run():
        async with _engine(path) as llm:
            cached = [(await llm.generate_async(prompt, params)).num_cached_tokens for _ in range(2)]
            _, weights = perturbed_hf_model(path)
            await llm.update_weights({await _device_id(llm): [(n, tensor_handle(t)) for n, t in weights]})
            await llm.update_weights(None)  # not paused, nothing running: paused around the update
            cached += [(await llm.generate_async(prompt, params)).num_cached_tokens for _ in range(2)]
            return cached

    assert asyncio.run(run()) == [0, 48, 0, 48]  # all but the last block, whose last token is computed


def test_pause_abort_ends_running_requests_and_holds_new_ones_until_resume(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def run():
        async with _engine(path) as llm:
            running = [llm.generate_async(TokensPrompt(prompt_token_ids=p), long) for p in PROMPTS]
            await asyncio.sleep(0.2)
            await llm.pause_generation()
            aborted = [await result for result in running]
            held = llm.generate_async(TokensPrompt(prompt_token_ids=PROMPTS[0]), SamplingParams(max_tokens=3))
            await asyncio.sleep(0.5)
            waiting = not held.finished
            await llm.resume_generation()
            return aborted, waiting, await held

    aborted, waiting, held = asyncio.run(run())
    for output in aborted:
        assert output.finished and len(output.outputs[0].token_ids) < 400
        assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("abort", "generation paused")
    assert waiting and len(held.outputs[0].token_ids) == 3


def test_pause_keep_parks_requests_that_go_on_with_the_new_weights(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    _, weights = perturbed_hf_model(path)

    async def run():
        async with _engine(path) as llm:
            device = await _device_id(llm)
            stream = llm.generate_async(TokensPrompt(prompt_token_ids=PROMPTS[0]), params, streaming=True)
            outputs = stream.__aiter__()  # held, not closed: closing a stream aborts its request
            while len((await outputs.__anext__()).outputs[0].token_ids) < 3:
                pass
            await llm.pause_generation(mode="keep")
            await llm.update_weights({device: [(n, tensor_handle(t)) for n, t in weights]})
            await llm.update_weights(None)
            await llm.resume_generation()
            return await stream

    final = asyncio.run(run())
    completion = final.outputs[0]
    assert len(completion.token_ids) == 40 and completion.finish_reason == "length"
    first_new = completion.weight_versions[1][0]
    assert completion.weight_versions == [(0, 0), (first_new, 1)] and 3 <= first_new < 40
    assert final.weight_version == 1


def test_pause_modes_are_checked(tiny_model_dirs):
    async def run():
        async with _engine(tiny_model_dirs["llama"]) as llm:
            with pytest.raises(ValueError, match="mode must be one of"):
                await llm.pause_generation(mode="later")
            running = llm.generate_async(TokensPrompt(prompt_token_ids=PROMPTS[0]),
                                         SamplingParams(max_tokens=300, ignore_eos=True))
            await asyncio.sleep(0.1)
            with pytest.raises(ValueError, match="pause_generation"):
                await llm.update_weights(None)
            running.abort()

    asyncio.run(run())


# ---------------------------------------------------------------------- mixture-of-experts weights under either name


def _moe_update(path, form: str, seed: int = 7):
    """(HF's Qwen3-MoE with new weights, those weights as a trainer sends them) for each form of update: every
    weight, the experts stacked as transformers holds them or per expert as checkpoints name them; one stacked
    tensor; or the per-expert tensors of two experts of layer 0 (1 and 6: on different ranks when split in two)."""
    if form == "two-experts":
        hf = hf_model(path)
        experts = hf.model.layers[0].mlp.experts
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in (experts.gate_up_proj, experts.down_proj):
                param[[1, 6]] += torch.randn(param[[1, 6]].shape, generator=generator) * 0.05
        stacked = [(name, param.detach().clone()) for name, param in hf.named_parameters()
                   if name.startswith("model.layers.0.mlp.experts.")]
        return hf, [(name, t) for name, t in per_expert(stacked) if ".experts.1." in name or ".experts.6." in name]
    names = {"model.layers.0.mlp.experts.down_proj"} if form == "one-stacked-tensor" else None
    hf, weights = perturbed_hf_model(path, names, seed)
    return hf, per_expert(weights) if form == "per-expert" else weights


@pytest.mark.parametrize("form", ["stacked", "per-expert", "one-stacked-tensor", "two-experts"])
def test_moe_updates_under_stacked_or_per_expert_names_give_hf_tokens_and_logprobs(tiny_model_dirs, form):
    path = tiny_model_dirs["qwen3_moe"]
    hf, weights = _moe_update(path, form)

    async def run():
        async with _engine(path) as llm:
            device = await _device_id(llm)
            await llm.pause_generation()
            await llm.update_weights({device: [(name, tensor_handle(t)) for name, t in weights]})
            await llm.update_weights(None)
            await llm.resume_generation()
            return await _generate(llm)

    _assert_matches_hf(hf, asyncio.run(run()))


# ---------------------------------------------------------------------- device memory by tag


ALL_TAGS = ["model_weights", "kv_cache", "cuda_graph", "model"]


def test_released_memory_refuses_generation_and_comes_back_exact(tiny_model_dirs):
    path = tiny_model_dirs["llama"]

    async def run():
        async with _engine(path) as llm:
            await llm.pause_generation()
            await llm.release(ALL_TAGS)
            await llm.release(["kv_cache"])  # again: nothing more to do
            status = (await llm.get_memory_status())[0]["tags"]
            with pytest.raises(ValueError, match="resume"):
                llm.generate_async(TokensPrompt(prompt_token_ids=PROMPTS[0]), GREEDY)
            with pytest.raises(ValueError, match="resume"):
                await llm.resume_generation()
            await llm.resume(["model_weights", "model"])
            await llm.resume(["kv_cache", "cuda_graph"])
            await llm.resume_generation()
            return status, (await llm.get_memory_status())[0]["tags"], await _generate(llm)

    released, resumed, outputs = asyncio.run(run())
    assert not any(entry["resident"] for entry in released.values()) and released["model_weights"]["bytes"] > 0
    assert all(entry["resident"] for entry in resumed.values())
    _assert_matches_hf(hf_model(path), outputs)


def test_discarded_weights_are_refilled_by_update_weights(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    hf, weights = perturbed_hf_model(path)

    async def run():
        async with _engine(path, sleep_config={"model_weights": "discard"}) as llm:
            device = await _device_id(llm)
            await llm.pause_generation()
            await llm.release(["model_weights", "kv_cache"])
            with pytest.raises(ValueError, match=r"resume\(\['model_weights'\]\)"):
                await llm.update_weights({device: [(n, tensor_handle(t)) for n, t in weights]})
            await llm.resume(["model_weights"])
            await llm.update_weights({device: [(n, tensor_handle(t)) for n, t in weights]})
            await llm.update_weights(None)
            await llm.resume(["kv_cache"])
            await llm.resume_generation()
            return await _generate(llm)

    _assert_matches_hf(hf, asyncio.run(run()))


def test_releasing_the_cache_sends_parked_requests_back_to_be_computed_again(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    async def run():
        async with _engine(path) as llm:
            with pytest.raises(ValueError, match="pause_generation"):
                running = llm.generate_async(TokensPrompt(prompt_token_ids=PROMPTS[1]),
                                             SamplingParams(max_tokens=300, ignore_eos=True))
                await asyncio.sleep(0.1)
                await llm.release(["kv_cache"])
            running.abort()
            stream = llm.generate_async(TokensPrompt(prompt_token_ids=PROMPTS[0]), params, streaming=True)
            outputs = stream.__aiter__()  # held, not closed: closing a stream aborts its request
            while len((await outputs.__anext__()).outputs[0].token_ids) < 3:
                pass
            await llm.pause_generation(mode="keep")
            await llm.release(["kv_cache"])
            await llm.resume(["kv_cache"])
            await llm.resume_generation()
            return await stream

    final = asyncio.run(run())
    assert final.outputs[0].token_ids == hf_greedy(hf_model(path), PROMPTS[0], 30)


# ---------------------------------------------------------------------- a trainer's weight-update group


def _broadcasting_trainer(port: int, weights_file: str) -> None:
    """Rank 0 of a weight-update group of two (the engine's one rank is rank 1): broadcasts each saved tensor."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    for _, tensor in torch.load(weights_file):
        group.broadcast(tensor, 0).wait()


def test_weights_broadcast_by_a_trainer_in_its_own_group(tiny_model_dirs, tmp_path):
    from raylm.actors.transport import free_address

    path = tiny_model_dirs["llama"]
    hf, weights = perturbed_hf_model(path)
    torch.save(weights, tmp_path / "weights.pt")
    port = free_address()[1]
    trainer = torch.multiprocessing.get_context("spawn").Process(
        target=_broadcasting_trainer, args=(port, str(tmp_path / "weights.pt")))
    trainer.start()

    async def run():
        async with _engine(path) as llm:
            await llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
            await llm.pause_generation()
            await llm.update_weights_from_distributed([name for name, _ in weights],
                                                      [str(tensor.dtype) for _, tensor in weights],
                                                      [list(tensor.shape) for _, tensor in weights])
            await llm.update_weights(None)
            await llm.resume_generation()
            await llm.destroy_weight_update_group()
            return await _generate(llm)

    outputs = asyncio.run(run())
    trainer.join(timeout=30)
    assert trainer.exitcode == 0
    _assert_matches_hf(hf, outputs)


def test_a_weight_update_group_that_never_forms_times_out_and_the_engine_serves_on(tiny_model_dirs):
    from raylm.actors.transport import free_address

    path = tiny_model_dirs["llama"]

    async def run():
        async with _engine(path) as llm:
            with pytest.raises(TimeoutError, match="weight-update group"):
                await llm.init_weight_update_group("127.0.0.1", free_address()[1], 1, 2, backend="gloo",
                                                   timeout_s=2.0)
            with pytest.raises(RuntimeError, match="init_weight_update_group"):
                await llm.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
            return await _generate(llm)

    _assert_matches_hf(hf_model(path), asyncio.run(run()))


# ---------------------------------------------------------------------- tensor parallelism over Ray (gloo)


@pytest.fixture(scope="module")
def _shared_by_file(ray_cluster):
    """CPU tensors reach unrelated processes (Ray actors) through files (weight_transfer's docstring)."""
    import ray.cloudpickle

    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    torch.multiprocessing.set_sharing_strategy(previous)


def test_tensor_parallel_ranks_cut_their_shards_from_full_updated_weights(tiny_model_dirs, _shared_by_file):
    path = tiny_model_dirs["llama"]
    hf, weights = perturbed_hf_model(path)

    async def run():
        async with AsyncLLM(model=str(path), tensor_parallel_size=2, skip_tokenizer_init=True, kv_cache_config=KV,
                            max_seq_len=512) as llm:
            devices = await llm.collective_rpc("report_device_id")
            bucket = pack_bucket(weights)
            await llm.pause_generation()
            await llm.update_weights({device: bucket.payload() for device in devices})
            await llm.update_weights(None)
            await llm.resume_generation()
            return await _generate(llm)

    _assert_matches_hf(hf, asyncio.run(run()))


@pytest.mark.parametrize("expert_parallel", [2, 1])
def test_moe_ranks_cut_their_experts_from_stacked_and_per_expert_updates(tiny_model_dirs, _shared_by_file,
                                                                         expert_parallel):
    """Two ranks holding four experts each (expert_parallel 2) or half of every expert's intermediate dimension
    (1); each update is followed by generation: two experts per expert, then all stacked, then all per expert."""
    path = tiny_model_dirs["qwen3_moe"]
    updates = [_moe_update(path, "two-experts"), _moe_update(path, "stacked"), _moe_update(path, "per-expert", 8)]

    async def run():
        async with AsyncLLM(model=str(path), tensor_parallel_size=2, moe_expert_parallel_size=expert_parallel,
                            skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512) as llm:
            devices = await llm.collective_rpc("report_device_id")
            outputs = []
            for _, weights in updates:
                bucket = pack_bucket(weights)
                await llm.pause_generation()
                await llm.update_weights({device: bucket.payload() for device in devices})
                await llm.update_weights(None)
                await llm.resume_generation()
                outputs.append(await _generate(llm))
            return outputs

    for (hf, _), outputs in zip(updates, asyncio.run(run()), strict=True):
        _assert_matches_hf(hf, outputs)
