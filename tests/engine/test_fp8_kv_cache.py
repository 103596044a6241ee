"""The FP8 KV cache (kv_cache_config.dtype='fp8'): keys and values in float8_e4m3fn with a float32 scale per token
and head, on the torch attention backend. The engine with it equals, bit for bit, a float32 engine whose attention
takes its keys and values quantized and dequantized the same way; its logprobs stay within FP8's precision of the
float cache's; its capacity nearly doubles (quadruples against float32) for the same bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from raylm import LLM, AsyncLLM, KvCacheConfig, LlmArgs, SamplingParams, TokensPrompt
from raylm.kernels import attention
from raylm.kernels.attention import fake_quantize_kv, read_kv_cache, write_kv_cache
from raylm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from raylm.models.source import default_model_path

FP8_KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16, dtype="fp8")
FP8_KV_PER_TENSOR = KvCacheConfig(max_tokens=2048, tokens_per_block=16, dtype="fp8", fp8_scales="per_tensor")
FLOAT_KV = KvCacheConfig(max_tokens=2048, tokens_per_block=16)
TINY = torch.finfo(torch.float32).tiny  # a zero row's scale
PROMPTS = [[(i * 7919 + j * 104729) % 49000 + 10 for j in range(40)] for i in range(3)]


# ------------------------------------------------------------------ configuration


def test_fp8_kv_cache_is_asked_for_by_kv_cache_config_or_quant_config_and_a_conflict_is_named():
    assert LlmArgs(kv_cache_config={"dtype": "fp8"}).kv_cache_dtype == "fp8"
    assert LlmArgs(quant_config={"kv_cache_quant_algo": "FP8"}).kv_cache_dtype == "fp8"
    assert LlmArgs().kv_cache_dtype == "auto"
    with pytest.raises(ValidationError, match=r"kv_cache_quant_algo='FP8'.*kv_cache_config.dtype is 'bfloat16'"):
        LlmArgs(quant_config={"kv_cache_quant_algo": "FP8"}, kv_cache_config={"dtype": "bfloat16"})
    with pytest.raises(ValidationError, match=r"kv_cache_config\.dtype\n.*'fp8'"):
        LlmArgs(kv_cache_config={"dtype": "fp4"})


def test_fp8_is_in_the_serve_schema():
    from raylm.serving.config import serve_args_schema

    schema = serve_args_schema()
    assert "fp8" in schema["$defs"]["KvCacheConfig"]["properties"]["dtype"]["enum"]


# ------------------------------------------------------------------ writing and reading the cache


def test_written_rows_read_back_as_their_per_token_and_head_quantization():
    generator = torch.Generator().manual_seed(0)
    blocks, block_size, heads, dim = 5, 4, 2, 16
    k, v = (torch.randn(6, heads, dim, generator=generator) for _ in range(2))
    k[2, 1] *= 500.0  # an outlier row: its own scale, the other rows keep theirs
    v[4, 0] = 0.0  # a zero row stays zero
    caches = [torch.zeros(blocks, block_size, heads, dim, dtype=FP8_DTYPE) for _ in range(2)]
    scales = [torch.zeros(blocks, block_size, heads) for _ in range(2)]
    slots = torch.tensor([4, 5, 6, 13, 14, 19])
    write_kv_cache(k, v, *caches, slots, tuple(scales))
    for new, cache, scale in zip((k, v), caches, scales):
        torch.testing.assert_close(scale.view(-1, heads)[slots], (new.abs().amax(-1) / FP8_MAX).clamp(min=TINY),
                                   rtol=0, atol=0)
        back = read_kv_cache(cache, scale, slots, torch.float32)
        assert torch.equal(back, fake_quantize_kv(new, scale))
        bound = new.abs().amax(-1, keepdim=True) * 2**-4  # e4m3: 3 mantissa bits, relative to each row's amax
        assert ((back - new).abs() <= bound).all()
        untouched = torch.ones(blocks * block_size, dtype=torch.bool)
        untouched[slots] = False
        assert not cache.view(-1, heads, dim)[untouched].float().any()
    assert not read_kv_cache(caches[1], scales[1], slots[4:5], torch.float32)[:, 0].any()
    # A float cache reads back what was written, in the dtype asked for.
    float_cache = torch.zeros(blocks, block_size, heads, dim)
    write_kv_cache(k, v, float_cache, torch.zeros_like(float_cache), slots)
    assert torch.equal(read_kv_cache(float_cache, None, slots, torch.float32), k)


# ------------------------------------------------------------------ the engine


def _generate(path, params: SamplingParams, **kwargs) -> list:
    """Each prompt's generated tokens and their logprobs, and its prompt's logprobs (teacher-forced)."""
    with LLM(str(path), skip_tokenizer_init=True, **kwargs) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [[(list(o.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs or []])
             for o in out.outputs]
            + [[{t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs[1:]]]
            for out in outputs]


GREEDY = SamplingParams(max_tokens=8, logprobs=0, prompt_logprobs=0, ignore_eos=True)
BEAMS = SamplingParams(max_tokens=6, n=2, use_beam_search=True, logprobs=0, prompt_logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("params", [GREEDY, BEAMS], ids=["greedy", "beam_search"])
def test_the_fp8_cache_equals_a_float_cache_fed_quantized_keys_and_values_exactly(tiny_model_dirs, arch, params,
                                                                                  monkeypatch):
    """Beam search copies blocks (scales with them) when beams fork. On the torch attention backend on every
    device: the Triton kernels apply the scales to the scores and probabilities instead of to each key and value
    (the same values, rounded in another order; their own tests hold them to the dequantized reference)."""
    path = tiny_model_dirs[arch]
    fp8 = _generate(path, params, kv_cache_config=FP8_KV, attention_backend="torch")
    paged_attention = attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention", lambda q, k, v, *rest: paged_attention(
        q, fake_quantize_kv(k, PER_ROW), fake_quantize_kv(v, PER_ROW), *rest))
    assert _generate(path, params, kv_cache_config=FLOAT_KV, attention_backend="torch") == fp8


PER_ROW = torch.zeros(2)  # fake_quantize_kv's scale argument for a cache with a scale per row (only its size counts)


@pytest.mark.parametrize("params", [GREEDY, BEAMS], ids=["greedy", "beam_search"])
def test_per_tensor_scales_equal_a_float_cache_fed_keys_and_values_quantized_by_them(tiny_model_dirs, params,
                                                                                      monkeypatch):
    """kv_cache_config.fp8_scales='per_tensor' without checkpoint scales: every key and value divided by 1.0;
    beam search's block copies leave the per-tensor scales alone."""
    path = tiny_model_dirs["llama"]
    fp8 = _generate(path, params, kv_cache_config=FP8_KV_PER_TENSOR, attention_backend="torch")
    paged_attention = attention.paged_attention
    one = torch.ones(1)
    monkeypatch.setattr(attention, "paged_attention", lambda q, k, v, *rest: paged_attention(
        q, fake_quantize_kv(k, one), fake_quantize_kv(v, one), *rest))
    assert _generate(path, params, kv_cache_config=FLOAT_KV, attention_backend="torch") == fp8
    assert fp8 != _generate(path, params, kv_cache_config=FP8_KV, attention_backend="torch")


def test_per_tensor_scales_come_from_the_checkpoint_s_k_scale_and_v_scale(tiny_model_dirs, tmp_path):
    """An FP8-KV checkpoint's static scales, under either name they are published with (self_attn.k_scale /
    v_scale, or k_proj / v_proj output_scale), are the per-tensor scales the cache divides by, and what
    fp8_scales='auto' (the default) takes; a per-row cache ignores them."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "with-kv-scales"
    shutil.copytree(tiny_model_dirs["llama"], path)
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.004)
    weights["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.03])
    save_file(weights, path / "model.safetensors")
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_config=FP8_KV_PER_TENSOR, executor="local") as llm:
        caches = llm._executor.worker.runner.kv_caches
        assert [(layer[2].item(), layer[3].item()) for layer in caches] == [
            pytest.approx((0.02, 0.004)), pytest.approx((0.03, 1.0))]
        for layer in caches:  # a resume at the same addresses brings the pages back with any contents
            layer[2].fill_(7.0)
        llm._executor.worker.runner.zero_unwritten_kv()
        assert caches[0][2].item() == pytest.approx(0.02) and caches[1][2].item() == pytest.approx(0.03)
        assert llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]), SamplingParams(max_tokens=2)).outputs
    per_token = FP8_KV.model_copy(update={"fp8_scales": "per_token"})
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_config=per_token, executor="local") as llm:
        assert llm._executor.worker.runner.kv_caches[0][2].shape[:2] == (2048 // 16 + 1, 16)
    with LLM(str(path), skip_tokenizer_init=True, kv_cache_config=FP8_KV, executor="local") as llm:  # auto
        assert [layer[2].item() for layer in llm._executor.worker.runner.kv_caches] == pytest.approx([0.02, 0.03])
    weights["model.layers.0.self_attn.v_scale"] = torch.ones(4)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match="v_scale' must be one positive KV-cache scale"):
        LLM(str(path), skip_tokenizer_init=True, kv_cache_config=FP8_KV_PER_TENSOR, executor="local")


LOGPROB_GAP_BOUND = 0.05  # mean |FP8 cache - float32 cache| of the prompts' logprobs; measured 0.020-0.031 (max 0.12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe"])
def test_fp8_cache_logprobs_stay_within_fp8_precision_of_the_float_cache(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
    fp8 = _generate(path, GREEDY, kv_cache_config=FP8_KV)
    reference = _generate(path, GREEDY, kv_cache_config=FLOAT_KV)
    gaps = torch.tensor([abs(ours[token] - theirs[token]) for one, other in zip(fp8, reference)
                         for ours, theirs in zip(one[-1], other[-1]) for token in ours])
    assert (gaps > 0).any() and gaps.mean() < LOGPROB_GAP_BOUND and gaps.max() < 0.5, (gaps.mean(), gaps.max())


def test_a_prefix_reused_from_the_fp8_cache_gives_what_computing_it_gave(tiny_model_dirs):
    """The second request's prefix blocks come from the cache (quantized by the first request): its tokens and
    their logprobs equal the first's."""
    params = SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True)
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=FP8_KV) as llm:
        first, second = (llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]), params) for _ in range(2))
        assert llm.get_stats(timeout=1)[-1]["kvCacheStats"]["reusedBlocks"] > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].logprobs == first.outputs[0].logprobs


def test_auto_scales_are_per_token_without_the_checkpoint_s_kv_scales(tiny_model_dirs):
    """fp8_scales='auto' (the default) on a checkpoint without KV scales: a float32 scale per token and head."""
    assert FP8_KV.fp8_scales == "auto"
    with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=FP8_KV, executor="local") as llm:
        runner = llm._executor.worker.runner
        assert runner.fp8_kv_scales == "per_token" and runner.kv_caches[0][2].shape[:2] == (2048 // 16 + 1, 16)


def test_the_cache_holds_four_times_the_tokens_of_float32_in_the_same_bytes(tiny_model_dirs):
    # On the CPU, whose cache has a fixed byte budget (a GPU's follows its free memory, and 'auto' is bfloat16 there).
    def max_blocks(dtype: str, fp8_scales: str = "per_token") -> int:
        kv = KvCacheConfig(tokens_per_block=16, dtype=dtype, fp8_scales=fp8_scales)
        with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=kv, device="cpu",
                 dtype="float32") as llm:
            llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]), SamplingParams(max_tokens=1))
            return llm.get_stats(timeout=1)[-1]["kvCacheStats"]["maxNumBlocks"]

    head_dim = 16  # the tiny models' (hidden 64, 4 heads)
    ratio = max_blocks("fp8") / max_blocks("auto")
    assert ratio == pytest.approx(4 / (1 + 4 / head_dim), rel=1e-3)  # one byte and a float32 scale per row
    assert max_blocks("fp8", "per_tensor") / max_blocks("auto") == pytest.approx(4, rel=1e-5)  # no scale per row


def test_fp8_smollm2_still_answers_paris():
    try:
        default_model_path()
    except ValueError as exc:  # the GPU machine has no embedded model
        pytest.skip(str(exc))
    with LLM(kv_cache_config=KvCacheConfig(max_tokens=512, dtype="fp8")) as llm:
        output = llm.generate("The capital of France is", SamplingParams(max_tokens=3))
    assert output.outputs[0].text.startswith(" Paris.")


def test_release_and_resume_bring_back_an_fp8_cache_that_generates_the_same(tiny_model_dirs):
    async def run():
        async with AsyncLLM(model=str(tiny_model_dirs["llama"]), executor="local", skip_tokenizer_init=True,
                            kv_cache_config=FP8_KV, max_seq_len=512) as llm:
            prompt = TokensPrompt(prompt_token_ids=PROMPTS[1])
            params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
            before = await llm.generate_async(prompt, params)
            await llm.pause_generation()
            await llm.release(["kv_cache"])
            released = (await llm.get_memory_status())[0]["tags"]["kv_cache"]
            await llm.resume(["kv_cache"])
            await llm.resume_generation()
            return before, released, await llm.generate_async(prompt, params)

    before, released, after = asyncio.run(run())
    assert not released["resident"] and released["bytes"] > 0
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.outputs[0].logprobs == before.outputs[0].logprobs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fp8_attention", ["float16", "float16_slices", "float16_keys_first"])
@pytest.mark.parametrize("kv", [FP8_KV, FP8_KV_PER_TENSOR], ids=["per_token", "per_tensor"])
def test_the_triton_kernels_on_an_fp8_cache_give_the_torch_reference_s_tokens(tiny_model_dirs, arch, fp8_attention,
                                                                               kv):
    """float32 on the GPU, the decode graphs on: the Triton writes and attention (prefill, decode with the rotation
    inside, split K; decode tiles whole, in slices of keys a warp or with the keys first) against the torch backend
    on the same FP8 cache layout, scaled per token or per tensor."""
    path = tiny_model_dirs[arch]
    options = dict(kv_cache_config=kv, device="cuda", dtype="float32", executor="local")
    triton_run = _generate(path, GREEDY, attention_backend="triton", kernel_config={"fp8_attention": fp8_attention},
                           **options)
    reference = _generate(path, GREEDY, attention_backend="torch", **options)
    for ours, theirs in zip(triton_run, reference):
        assert ours[0][0] == theirs[0][0]  # the greedy tokens
        for mine, other in zip(ours[0][1] + ours[-1], theirs[0][1] + theirs[-1]):
            assert mine.keys() == other.keys()
            assert max(abs(mine[token] - other[token]) for token in mine) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_products_in_decode_attention_stay_near_the_torch_reference():
    """kernel_config.fp8_attention='fp8': decode's products on FP8 tensor cores, the queries and probabilities in
    FP8 too, in bfloat16 with the decode graphs on, on SmolLM2-135M's shape (64-dimension heads) with random weights:
    the first token of the torch backend on the same cache, and the logprobs of every token up to where the two
    first part within FP8's rounding of the queries and probabilities. The prompts' prefills run eagerly (a prefill
    graph's rows would take the decode kernel's FP8 products too), so the first token compares decode alone."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "smollm2-135m"
    options = dict(kv_cache_config=FP8_KV, device="cuda", dtype="bfloat16", executor="local", load_format="dummy",
                   cuda_graph_config={"prefill_max_tokens": 0})
    fp8_dot = _generate(path, GREEDY, attention_backend="triton", kernel_config={"fp8_attention": "fp8"}, **options)
    reference = _generate(path, GREEDY, attention_backend="torch", **options)
    for ours, theirs in zip(fp8_dot, reference):
        (tokens, logprobs), (reference_tokens, reference_logprobs) = ours[0], theirs[0]
        assert tokens[0] == reference_tokens[0]
        for token, reference_token, mine, other in zip(tokens, reference_tokens, logprobs, reference_logprobs):
            if token != reference_token:
                break
            assert abs(mine[token] - other[token]) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("kv", [FP8_KV, FP8_KV_PER_TENSOR], ids=["per_token", "per_tensor"])
def test_fp8_cache_at_tensor_parallel_size_2_equals_one_rank(ray_cluster, tiny_model_dirs, kv):
    """Two ranks over gloo, each holding its KV heads' rows and scales (a row is one head's, so each rank quantizes
    exactly what one rank does; per-tensor scales are every rank's): the same tokens, logprobs equal up to the
    order of the all-reduce's sums."""
    path = tiny_model_dirs["llama"]
    two = _generate(path, GREEDY, kv_cache_config=kv, tensor_parallel_size=2)
    one = _generate(path, GREEDY, kv_cache_config=kv, executor="local")
    assert [prompt[0][0] for prompt in two] == [prompt[0][0] for prompt in one]
    for ours, theirs in zip(two, one):
        for mine, other in zip(ours[0][1] + ours[-1], theirs[0][1] + theirs[-1]):
            assert max(abs(mine[token] - other[token]) for token in mine) < 1e-4
