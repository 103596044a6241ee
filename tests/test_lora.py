"""Multi-LoRA through the LLM API: greedy tokens and logprobs equal HF + PEFT's for each adapter, adapters and the
base model mixed in one generate call (more adapters than device slots, so requests wait and slots are reused),
generate_async, the prefix cache kept apart per adapter, and the refusals of bad configs and requests."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from raylm import LLM, KvCacheConfig, LoraConfig, LoRARequest, SamplingParams, TokensPrompt
from tests.conftest import hf_greedy, hf_peft_model, logprob_errors

PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040] * 3, [2, 9, 77, 1203, 11, 8, 3]]
NEW_TOKENS = 12
KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16)
_references: dict[str | None, list[list[int]]] = {}


def _request(tiny_lora_dirs, name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, list(tiny_lora_dirs).index(name) + 1, str(tiny_lora_dirs[name]))


def _reference(tiny_model_dirs, tiny_lora_dirs, name: str | None) -> list[list[int]]:
    """HF + PEFT's greedy tokens of PROMPTS with adapter `name` (None: the base model)."""
    if name not in _references:
        model = hf_peft_model(tiny_model_dirs["llama"], tiny_lora_dirs[name] if name else None)
        _references[name] = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return _references[name]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs, tiny_lora_dirs):
    """Two device slots for three adapters; a CPU cache of two."""
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512,
             lora_config=LoraConfig(lora_dir=[str(tiny_lora_dirs["r8"])], max_loras=2, max_lora_rank=64)) as engine:
        yield engine


def _generate(llm, prompts, lora_request, params=None):
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        params or SamplingParams(max_tokens=NEW_TOKENS), use_tqdm=False, lora_request=lora_request)


@pytest.mark.parametrize("name", ["r8", "r64", "qv"])
def test_adapter_greedy_tokens_and_logprobs_equal_hf_peft(llm, tiny_model_dirs, tiny_lora_dirs, name):
    reference = hf_peft_model(tiny_model_dirs["llama"], tiny_lora_dirs[name])
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0)
    outputs = _generate(llm, PROMPTS, _request(tiny_lora_dirs, name), params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, NEW_TOKENS)
        generated, prompt_errors = logprob_errors(reference, prompt, output)
        assert max(generated + prompt_errors) < 1e-4
    assert [o.outputs[0].token_ids for o in outputs] != _reference(tiny_model_dirs, tiny_lora_dirs, None)


def test_adapters_and_the_base_model_mixed_in_one_call_each_match_their_reference(llm, tiny_model_dirs,
                                                                                  tiny_lora_dirs):
    """Three adapters and the base model in one batch on two slots: requests wait for a slot, and adapters take
    the slots of those whose requests finished."""
    names = [None, "r8", "r64", "qv", "r8", None, "qv", "r64"]
    rows = [(name, index % len(PROMPTS)) for index, name in enumerate(names)]
    outputs = _generate(llm, [PROMPTS[p] for _, p in rows], [_request(tiny_lora_dirs, n) for n, _ in rows])
    for (name, prompt_index), output in zip(rows, outputs):
        assert output.outputs[0].token_ids == _reference(tiny_model_dirs, tiny_lora_dirs, name)[prompt_index], name


def test_generate_async_takes_a_lora_request(llm, tiny_model_dirs, tiny_lora_dirs):
    async def run():
        results = [llm.generate_async(TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=NEW_TOKENS),
                                      lora_request=_request(tiny_lora_dirs, "qv")) for prompt in PROMPTS]
        return [(await result).outputs[0].token_ids for result in results]

    assert asyncio.run(run()) == _reference(tiny_model_dirs, tiny_lora_dirs, "qv")


def test_prefix_cache_blocks_are_not_shared_across_adapters(llm, tiny_model_dirs, tiny_lora_dirs):
    prompt = list(range(3000, 3050))  # three full blocks of 16
    params = SamplingParams(max_tokens=4)

    def cached(name):
        output = _generate(llm, [prompt], _request(tiny_lora_dirs, name), params)[0]
        return output.num_cached_tokens, output.outputs[0].token_ids

    first_r8 = cached("r8")
    assert first_r8[0] == 0
    assert cached("r8") == (48, first_r8[1])  # the same adapter reuses its blocks
    r64 = cached("r64")
    assert r64[0] == 0  # another adapter's KV is not this one's
    base = cached(None)
    assert base[0] == 0
    reference = hf_peft_model(tiny_model_dirs["llama"], tiny_lora_dirs["r64"])
    assert r64[1] == hf_greedy(reference, prompt, 4)
    assert cached(None) == (48, base[1])


def test_preempted_requests_take_a_slot_again_and_keep_their_adapter(tiny_model_dirs, tiny_lora_dirs):
    """A KV cache of 4 blocks for requests of 1 or 2 blocks each: requests are preempted and computed again, each
    with its adapter (in whichever slot it has then)."""
    names = ["r8", None, "r64", None, "qv", "r8", None, "r64"]
    rows = [(name, index % len(PROMPTS)) for index, name in enumerate(names)]
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, max_seq_len=512,
             kv_cache_config=KvCacheConfig(max_tokens=64, tokens_per_block=16),
             lora_config=LoraConfig(max_loras=2)) as small:
        outputs = _generate(small, [PROMPTS[p] for _, p in rows], [_request(tiny_lora_dirs, n) for n, _ in rows])
        stats = small.get_stats(timeout=1)
    assert sum(entry["inflightBatchingStats"]["numPausedRequests"] for entry in stats) > 0
    for (name, prompt_index), output in zip(rows, outputs):
        assert output.outputs[0].token_ids == _reference(tiny_model_dirs, tiny_lora_dirs, name)[prompt_index], name


def test_workers_reload_an_evicted_adapter_from_their_cpu_copy(tiny_model_dirs, tiny_lora_dirs, tmp_path):
    """One device slot and two CPU copies: an adapter whose slot another took comes back from the workers' copy
    (its files are gone by then)."""
    copies = {name: shutil.copytree(tiny_lora_dirs[name], tmp_path / name) for name in ("r8", "qv")}
    requests = {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(copies.items())}
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512,
             lora_config=LoraConfig(max_loras=1, max_cpu_loras=2)) as llm:
        first = _generate(llm, PROMPTS, requests["r8"])
        _generate(llm, PROMPTS, requests["qv"])
        shutil.rmtree(copies["r8"])
        again = _generate(llm, PROMPTS, requests["r8"])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first] == \
        _reference(tiny_model_dirs, tiny_lora_dirs, "r8")


def test_speculative_decoding_verifies_drafts_with_each_request_s_adapter(tiny_model_dirs, tiny_lora_dirs):
    """Prompt lookup's verify steps run each drafted row with its request's adapter: greedy tokens equal HF +
    PEFT's for adapters and the base model mixed, with drafts proposed (the prompts repeat themselves)."""
    from raylm import NGramDecodingConfig

    rows = [("r8", 1), ("qv", 2), (None, 1), ("r64", 0)]
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512,
             lora_config=LoraConfig(max_loras=2, max_lora_rank=64),
             speculative_config=NGramDecodingConfig(max_draft_len=4, max_matching_ngram_size=2)) as llm:
        outputs = _generate(llm, [PROMPTS[p] for _, p in rows], [_request(tiny_lora_dirs, n) for n, _ in rows])
        totals = llm.get_stats(timeout=2)[-1]["specDecodingStats"]
    assert totals["totalDraftTokens"] > 0
    for (name, prompt_index), output in zip(rows, outputs):
        assert output.outputs[0].token_ids == _reference(tiny_model_dirs, tiny_lora_dirs, name)[prompt_index], name


# ---------------------------------------------------------------------- refusals


def test_lora_request_without_lora_config_is_refused(tiny_model_dirs, tiny_lora_dirs):
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512) as plain:
        with pytest.raises(ValueError, match="lora_config"):
            _generate(plain, PROMPTS[:1], _request(tiny_lora_dirs, "r8"))


def test_adapter_above_max_lora_rank_is_refused_at_submit(tiny_model_dirs, tiny_lora_dirs):
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512,
             lora_config=LoraConfig(max_lora_rank=16)) as narrow:
        with pytest.raises(ValueError, match=r"r=64 exceeds lora_config.max_lora_rank \(16\)"):
            _generate(narrow, PROMPTS[:1], _request(tiny_lora_dirs, "r64"))
        assert _generate(narrow, PROMPTS[:1], _request(tiny_lora_dirs, "r8"))[0].outputs[0].token_ids == \
            _reference(tiny_model_dirs, tiny_lora_dirs, "r8")[0]


def test_bad_adapter_in_lora_dir_is_refused_at_start(tiny_model_dirs, tiny_lora_dirs, tmp_path):
    bad = tmp_path / "bias"
    shutil.copytree(tiny_lora_dirs["r8"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(ValueError, match="bias must be 'none'"):
        LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV,
            lora_config=LoraConfig(lora_dir=[str(bad)]))


def test_one_id_names_one_adapter(llm, tiny_lora_dirs):
    _generate(llm, PROMPTS[:1], _request(tiny_lora_dirs, "r8"))
    with pytest.raises(ValueError, match="lora_int_id 1 already holds the adapter .*: use another lora_int_id"):
        _generate(llm, PROMPTS[:1], LoRARequest("other", 1, str(tiny_lora_dirs["qv"])))


def test_lora_request_must_be_a_lora_request_and_one_per_prompt(llm, tiny_lora_dirs):
    with pytest.raises(TypeError, match="LoRARequest"):
        _generate(llm, PROMPTS[:1], {"lora_path": str(tiny_lora_dirs["r8"])})
    with pytest.raises(ValueError, match="lora_request has 1 entries but there are 2 prompts"):
        _generate(llm, PROMPTS[:2], [_request(tiny_lora_dirs, "r8")])


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_loras": 0}, "lora_config.max_loras must be >= 1, got 0"),
    ({"max_lora_rank": 0}, "lora_config.max_lora_rank must be >= 1, got 0"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"lora_config.max_cpu_loras must be >= max_loras \(4\), got 2"),
    ({"max_rank": 8}, "max_rank"),
])
def test_bad_lora_config_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"lora_int_id": 0}, "lora_int_id must be an integer >= 1, got 0"),
    ({"lora_int_id": True}, "lora_int_id must be an integer >= 1"),
    ({"lora_path": 3}, "lora_path must be a string"),
])
def test_bad_lora_requests_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "/a", **fields})



# ---------------------------------------------------------------------- decode graphs (CUDA)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "kernels"), [
    # the expand kernel after the matmul (with the decode GEMV: half precision only), then the products on a second
    # stream beside it (a branch of the graph; the default); in float32 against PEFT too
    ("float32", {"lora_expand": "kernel"}), ("bfloat16", {"lora_expand": "kernel"}),
    ("bfloat16", {"decode_gemv": True, "lora_expand": "kernel"}),
    ("float32", {}), ("bfloat16", {}), ("bfloat16", {"decode_gemv": True})], ids=str)
def test_decode_graphs_give_the_eager_tokens_with_adapters_mixed_per_row(tiny_model_dirs, tiny_lora_dirs, dtype,
                                                                         kernels):
    """On CUDA the decode graphs of an engine with adapters are captured once and read each row's slot from a
    buffer of theirs (the adapted layers' Triton kernels inside the graph): adapters and the base model mixed in
    one batch, and slots reused between generate calls, give the tokens of the same engine without graphs."""
    names = [None, "r8", "qv", "r64", "r8", None]
    rows = [(name, index % len(PROMPTS)) for index, name in enumerate(names)]
    prompts = [PROMPTS[p] for _, p in rows]
    lora_requests = [_request(tiny_lora_dirs, n) for n, _ in rows]
    runs = {}
    for graphs in (True, False):
        with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512,
                 dtype=dtype, device="cuda", lora_config=LoraConfig(max_loras=2, max_lora_rank=64),
                 kernel_config=kernels, **({} if graphs else {"cuda_graph_config": None})) as llm:
            captured = "gen_cuda_graph_capture_seconds" in llm.startup_metrics.get("final_model_engine", {})
            assert captured == graphs
            first = _generate(llm, prompts, lora_requests)
            again = _generate(llm, prompts[::-1], lora_requests[::-1])
            runs[graphs] = ([o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in again])
    assert runs[True] == runs[False]
    if dtype == "float32":
        for (name, prompt_index), tokens in zip(rows, runs[True][0]):
            assert tokens == _reference(tiny_model_dirs, tiny_lora_dirs, name)[prompt_index], name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_prefill_of_many_rows_adds_each_prompt_s_adapter_in_segments(tiny_model_dirs, tiny_lora_dirs):
    """A CUDA step of more rows than decode's (here six 21-token prompts in one prefill) adds the adapters in the
    segment kernels, runs of each prompt's rows on the tensor cores: float32 tokens equal HF + PEFT's."""
    names = ["r8", None, "qv", "r64", "r8", "qv"]
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=512,
             dtype="float32", device="cuda", lora_config=LoraConfig(max_loras=3, max_lora_rank=64)) as llm:
        outputs = _generate(llm, [PROMPTS[1]] * len(names), [_request(tiny_lora_dirs, n) for n in names])
    for name, output in zip(names, outputs):
        assert output.outputs[0].token_ids == _reference(tiny_model_dirs, tiny_lora_dirs, name)[1], name
