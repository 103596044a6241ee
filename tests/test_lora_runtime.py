"""LoRA adapters at run time, as an RL loop uses them: an adapter handed over in memory (PEFT's config and state
dict, no files) gives HF + PEFT's tokens; remove_lora then add_lora under the same id replaces it, and KV cached
with the old adapter is not reused; add_lora keeps an adapter read from disk; the refusals."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from raylm import LLM, KvCacheConfig, LoraConfig, LoRARequest, SamplingParams, TokensPrompt
from tests.conftest import hf_greedy, hf_model, hf_peft_model

PROMPT = list(range(3000, 3050))  # three full blocks of 16
NEW_TOKENS = 8


def _trained_adapter(base, rank: int, seed: int):
    """An adapter as a trainer holds it: a PEFT model's config (to_dict) and state dict, random non-zero weights;
    and the PEFT model itself, the reference."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(base), PeftLoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                                                          target_modules=["q_proj", "v_proj", "down_proj"]))
    model.eval()
    return model.peft_config["default"].to_dict(), get_peft_model_state_dict(model), model


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_seq_len=512,
             kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=16),
             lora_config=LoraConfig(max_loras=2, max_lora_rank=16)) as engine:
        yield engine


def _generate(llm, lora_request, prompt=PROMPT):
    output = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=NEW_TOKENS),
                          use_tqdm=False, lora_request=lora_request)
    return output.num_cached_tokens, output.outputs[0].token_ids


def test_an_adapter_in_memory_is_replaced_under_its_id_and_its_cached_kv_is_not_reused(llm, tiny_model_dirs):
    base = tiny_model_dirs["llama"]
    config, tensors, first_reference = _trained_adapter(base, 8, seed=11)
    first = LoRARequest("policy", 7, peft_config=config, lora_tensors=tensors)
    assert llm.add_lora(first) is True
    assert llm.add_lora(first) is False  # the id holds it already
    by_id = LoRARequest("policy", 7)
    cached, tokens = _generate(llm, by_id)
    assert (cached, tokens) == (0, hf_greedy(first_reference, PROMPT, NEW_TOKENS))
    assert _generate(llm, first) == (48, tokens)  # the adding request itself, and its KV reused
    assert [lora.lora_int_id for lora in llm.list_loras()] == [7]
    assert llm.collective_rpc("list_loras") == [[7]]

    config, tensors, second_reference = _trained_adapter(base, 16, seed=12)
    second = LoRARequest("policy", 7, peft_config=config, lora_tensors=tensors)
    with pytest.raises(ValueError, match=r"remove_lora\(7\) first"):
        llm.add_lora(second)
    assert llm.remove_lora(7) is True
    assert llm.remove_lora(7) is False
    assert llm.list_loras() == [] and llm.collective_rpc("list_loras") == [[]]
    with pytest.raises(ValueError, match="no LoRA adapter was added under lora_int_id 7"):
        _generate(llm, by_id)
    cached, tokens = _generate(llm, second)  # added by its first request
    expected = hf_greedy(second_reference, PROMPT, NEW_TOKENS)
    assert (cached, tokens) == (0, expected)  # the first adapter's blocks of this prompt are not this one's
    assert expected != hf_greedy(first_reference, PROMPT, NEW_TOKENS)
    llm.remove_lora(7)


def test_add_lora_keeps_an_adapter_from_disk_after_its_files_go(llm, tiny_model_dirs, tiny_lora_dirs, tmp_path):
    copy = shutil.copytree(tiny_lora_dirs["qv"], tmp_path / "qv")
    assert llm.add_lora(LoRARequest("qv", 3, str(copy))) is True
    shutil.rmtree(copy)
    for other_id, name in ((4, "r8"), (5, "r8"), (6, "r8")):  # more adapters than slots and CPU copies
        _generate(llm, LoRARequest(name, other_id, str(tiny_lora_dirs[name])), PROMPT[:5])
    reference = hf_peft_model(tiny_model_dirs["llama"], tiny_lora_dirs["qv"])
    assert _generate(llm, LoRARequest("qv", 3), PROMPT[:5])[1] == hf_greedy(reference, PROMPT[:5], NEW_TOKENS)
    assert {lora.lora_int_id for lora in llm.list_loras()} >= {3, 4, 5, 6}
    for lora_id in (3, 4, 5, 6):
        assert llm.remove_lora(lora_id)


def test_an_adapter_in_use_is_not_removed_and_its_requests_go_on(llm, tiny_model_dirs):
    config, tensors, reference = _trained_adapter(tiny_model_dirs["llama"], 8, seed=13)
    lora = LoRARequest("busy", 9, peft_config=config, lora_tensors=tensors)

    async def run():
        result = llm.generate_async(TokensPrompt(prompt_token_ids=PROMPT[:6]), SamplingParams(max_tokens=200,
                                                                                               ignore_eos=True),
                                    lora_request=lora)
        with pytest.raises(ValueError, match="in use by 1 unfinished request"):
            llm.remove_lora(9)
        return (await result).outputs[0].token_ids

    tokens = asyncio.run(run())
    assert tokens[:NEW_TOKENS] == hf_greedy(reference, PROMPT[:6], NEW_TOKENS) and len(tokens) == 200
    assert llm.remove_lora(9) is True


@pytest.mark.parametrize(("fields", "message"), [
    ({"peft_config": {"r": 8}}, "needs both peft_config and lora_tensors"),
    ({"lora_path": "/x", "peft_config": {}, "lora_tensors": {}}, "not both"),
    ({"peft_config": [], "lora_tensors": {}}, "must be mappings"),
])
def test_bad_in_memory_lora_requests_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest("a", 1, **fields)


def test_an_in_memory_adapter_that_does_not_fit_is_refused_naming_the_tensor(llm, tiny_model_dirs):
    config, tensors, _ = _trained_adapter(tiny_model_dirs["llama"], 8, seed=14)
    name = next(key for key in tensors if key.endswith("q_proj.lora_A.weight"))
    bad = {**tensors, name: tensors[name][:, :-1]}
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape"):
        llm.add_lora(LoRARequest("bad", 10, peft_config=config, lora_tensors=bad))
    with pytest.raises(ValueError, match="exceeds lora_config.max_lora_rank"):
        llm.add_lora(LoRARequest("big", 10, peft_config={**config, "r": 32}, lora_tensors=tensors))
    assert llm.list_loras() == []


def test_async_llm_takes_a_trainer_s_adapter_on_its_ray_worker(ray_cluster, tiny_model_dirs):
    """The RL loop's calls on AsyncLLM, whose engine runs on a Ray worker: the adapter crosses to the worker as
    plain values (PEFT's config object holds a set and PEFT's enum), generates PEFT's tokens by name and id, and is
    replaced under its id."""
    from raylm import AsyncLLM

    base = tiny_model_dirs["llama"]
    adapters = [_trained_adapter(base, 8, seed=21), _trained_adapter(base, 4, seed=22)]

    async def run():
        async with AsyncLLM(model=str(base), skip_tokenizer_init=True, max_seq_len=512,
                            kv_cache_config=KvCacheConfig(max_tokens=1024, tokens_per_block=16),
                            lora_config=LoraConfig(max_loras=1, max_lora_rank=16)) as llm:
            tokens = []
            for config, tensors, _ in adapters:
                await llm.remove_lora(5)
                assert await llm.add_lora(LoRARequest("policy", 5, peft_config=config, lora_tensors=tensors))
                assert [lora.lora_int_id for lora in await llm.list_loras()] == [5]
                output = await llm.generate_async(TokensPrompt(prompt_token_ids=PROMPT),
                                                  SamplingParams(max_tokens=NEW_TOKENS),
                                                  lora_request=LoRARequest("policy", 5))
                tokens.append(output.outputs[0].token_ids)
            return tokens

    tokens = asyncio.run(run())
    assert tokens == [hf_greedy(model, PROMPT, NEW_TOKENS) for _, _, model in adapters]
