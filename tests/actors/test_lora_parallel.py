"""Multi-LoRA across ranks on CPU (gloo): under TP=2 (column-parallel layers keep A whole and their rows of B,
row-parallel ones their columns of A, their products all-reduced with the layer's) and PP=2 (each stage loads its
layers' share), adapters and the base model mixed in one call give HF + PEFT's greedy tokens; an adapter replaced
in memory under its id (remove_lora, add_lora: every rank takes the new tensors) gives the new adapter's."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from raylm import LLM, KvCacheConfig, LoraConfig, LoRARequest, SamplingParams, TokensPrompt
from tests.conftest import hf_greedy, hf_peft_model

PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040] * 3]
NEW_TOKENS = 10
NAMES = [None, "r8", "r64", "qv"]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_mixed_adapters_across_ranks_match_hf_peft(ray_cluster, tiny_model_dirs, tiny_lora_dirs, tp, pp):
    base = tiny_model_dirs["llama"]
    rows = [(name, prompt) for name in NAMES for prompt in PROMPTS]
    requests = {name: LoRARequest(name, index, str(tiny_lora_dirs[name]))
                for index, name in enumerate(NAMES) if name is not None}
    with LLM(str(base), skip_tokenizer_init=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
             kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=16), max_seq_len=512,
             lora_config=LoraConfig(max_loras=2, max_lora_rank=64)) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for _, prompt in rows],
                               SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False,
                               lora_request=[requests.get(name) for name, _ in rows])
        # Id 1 (r8) becomes qv, handed over in memory as a trainer would.
        assert llm.remove_lora(1)
        qv = tiny_lora_dirs["qv"]
        llm.add_lora(LoRARequest("policy", 1, peft_config=json.loads((qv / "adapter_config.json").read_text()),
                                 lora_tensors=load_file(str(qv / "adapter_model.safetensors"))))
        assert llm.collective_rpc("list_loras") == [[1]] * (tp * pp)
        replaced = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS],
                                SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False,
                                lora_request=LoRARequest("policy", 1))
    references = {name: hf_peft_model(base, tiny_lora_dirs[name] if name else None) for name in NAMES}
    for (name, prompt), output in zip(rows, outputs):
        assert output.outputs[0].token_ids == hf_greedy(references[name], prompt, NEW_TOKENS), name
    for prompt, output in zip(PROMPTS, replaced):
        assert output.outputs[0].token_ids == hf_greedy(references["qv"], prompt, NEW_TOKENS)
