"""The GPU path (Triton kernels, CUDA graphs, sampling on the device) against HF transformers and the
torch path. Runs only where CUDA is available."""

from __future__ import annotations

import pytest
import torch

from raylm import LLM, KvCacheConfig, SamplingParams, TokensPrompt
from tests.conftest import hf_greedy, logprob_errors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[504, 3575, 282, 4649, 314], [19556, 28, 957, 1462, 314, 1133, 2040] * 9, [7, 7, 7],
           list(range(1000, 1100)), [2, 9, 77, 1203, 11, 8, 3, 40] * 3]
NEW_TOKENS = 32
KV = KvCacheConfig(max_tokens=8192, tokens_per_block=16)
BF16_LOGPROB_TOLERANCE = 0.1  # |bf16 - fp32 reference| per chosen token, stated for the bf16 path


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cuda", skip_tokenizer_init=True, kv_cache_config=KV, max_seq_len=1024, **kwargs)


def _run(llm: LLM, params: SamplingParams):
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)


def _hf_cuda(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("graphs", [True, False])
def test_fp32_greedy_tokens_equal_hf_on_gpu(tiny_model_dirs, arch, graphs):
    path = tiny_model_dirs[arch]
    extra = {} if graphs else {"cuda_graph_config": None}
    with _llm(path, dtype="float32", **extra) as llm:
        assert (llm._executor.worker.runner.graphs is not None) == graphs
        outputs = _run(llm, SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0))
    hf = _hf_cuda(path)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        generated, prompt_errors = logprob_errors(hf, prompt, output)
        assert len(prompt_errors) == len(prompt) - 1
        assert all(error < 1e-3 for error in generated + prompt_errors)


@pytest.mark.parametrize("gemv", [False, True], ids=["cublas", "triton-gemv"])
def test_bf16_logprobs_within_the_stated_tolerance(tiny_model_dirs, gemv):
    """Also with kernel_config.decode_gemv: decode linear layers through the Triton GEMV."""
    path = tiny_model_dirs["llama"]
    with _llm(path, dtype="bfloat16", kernel_config={"decode_gemv": gemv}) as llm:
        assert llm._executor.worker.runner.kernels.decode_gemv == gemv
        outputs = _run(llm, SamplingParams(max_tokens=8, logprobs=0))
    hf = _hf_cuda(path)
    for prompt, output in zip(PROMPTS, outputs):
        generated, _ = logprob_errors(hf, prompt, output)
        assert all(error < BF16_LOGPROB_TOLERANCE for error in generated)




def _assert_same_tokens_and_logprob_bits(runs) -> None:
    def bits(steps):
        return [{t: p.logprob for t, p in step.items()} for step in steps]

    for plain, other in zip(*runs):
        assert other.outputs[0].token_ids == plain.outputs[0].token_ids
        assert bits(other.outputs[0].logprobs) == bits(plain.outputs[0].logprobs)
        assert bits(other.prompt_logprobs[1:] if other.prompt_logprobs else []) == bits(
            plain.prompt_logprobs[1:] if plain.prompt_logprobs else [])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0+")
def test_pdl_changes_no_token_or_logprob(tiny_model_dirs):
    """kernel_config.pdl (kernels start before the previous one ends, kernels/pdl.py) with the Triton GEMV, decode
    graphs on: the same tokens and the same logprob bits as without it, prompt logprobs included."""
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0)
    runs = []
    for mode, trigger in (("off", 0), ("start", 1)):
        with _llm(tiny_model_dirs["llama"], dtype="bfloat16", kernel_config={"decode_gemv": True, "pdl": mode}) as llm:
            runner = llm._executor.worker.runner
            assert runner.graphs is not None and runner.kernels.pdl == trigger
            runs.append(_run(llm, params))
    _assert_same_tokens_and_logprob_bits(runs)


def test_graphs_pad_odd_batches_and_match_eager(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS[:3]]  # 3 sequences -> the graph of 4
    with _llm(path, dtype="float32") as graphed:
        with_graphs = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    with _llm(path, dtype="float32", cuda_graph_config=None) as eager:
        without = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert with_graphs == without


def test_greedy_steps_take_the_graphs_draws(tiny_model_dirs):
    """Plain greedy requests: decode steps take the logits and greedy draws their graphs computed (a greedy
    graph beside each forward graph), giving HF's tokens and the log-probabilities of the run without graphs;
    sampled steps take no precomputed draws."""
    path = tiny_model_dirs["llama"]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with _llm(path, dtype="float32", cuda_graph_config=None) as llm:
        eager = _run(llm, params)
    with _llm(path, dtype="float32") as llm:
        runner = llm._executor.worker.runner
        assert runner.graphs.greedy_graphs.keys() == runner.graphs.graphs.keys()
        taken: list[bool] = []
        sample = runner.sampler.sample

        def spy(logits, rows, greedy=None):
            pending = sample(logits, rows, greedy)
            taken.append(pending.precomputed)
            return pending

        runner.sampler.sample = spy
        graphed = _run(llm, params)
        greedy_steps = sum(taken)
        taken.clear()
        _run(llm, SamplingParams(max_tokens=8, temperature=0.8, seed=1))
        runner.sampler.sample = sample
    assert greedy_steps >= NEW_TOKENS - 2 and taken and not any(taken)
    hf = _hf_cuda(path)
    for prompt, without, with_graphs in zip(PROMPTS, eager, graphed):
        assert with_graphs.outputs[0].token_ids == without.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
        assert abs((with_graphs.outputs[0].cumulative_logprob or 0.0)
                   - (without.outputs[0].cumulative_logprob or 0.0)) < 1e-3


def test_graph_logits_can_be_turned_off(tiny_model_dirs):
    """cuda_graph_config.capture_logits=False: graphs of the forward alone, the logits and draws launched after
    them."""
    path = tiny_model_dirs["llama"]
    with _llm(path, dtype="float32", cuda_graph_config={"capture_logits": False}) as llm:
        graphs = llm._executor.worker.runner.graphs
        assert graphs.graphs and not graphs.with_logits and not graphs.greedy_graphs
        outputs = _run(llm, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    hf = _hf_cuda(path)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


def test_sampling_features_on_the_gpu(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    with _llm(path, dtype="bfloat16") as llm:
        seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=3,
                                repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1, logprobs=2)
        first = _run(llm, seeded)
        assert [o.outputs[0].token_ids for o in _run(llm, seeded)] == [o.outputs[0].token_ids for o in first]
        several = llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]),
                               SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1))
        assert len(several.outputs) == 3 and len({tuple(c.token_ids) for c in several.outputs}) > 1
        beams = llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]),
                             SamplingParams(n=2, use_beam_search=True, max_tokens=8))
        assert len(beams.outputs) == 2
        stopped = llm.generate(TokensPrompt(prompt_token_ids=PROMPTS[0]),
                               SamplingParams(max_tokens=30, min_tokens=5, stop_token_ids=[first[0].outputs[0]
                                                                                          .token_ids[6]]))
        assert len(stopped.outputs[0].token_ids) >= 5


def test_kv_capacity_comes_from_free_memory(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), device="cuda", skip_tokenizer_init=True,
             kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.05)) as llm:
        capacity = llm.get_kv_cache_capacity()
    free, _ = torch.cuda.mem_get_info()
    assert capacity["maxNumBlocks"] > 1000


def test_no_kernel_compiles_once_started(tiny_model_dirs):
    """Start-up (the profiling forward, graph capture) compiles every Triton kernel variant the engine needs:
    batches of new sizes, block tables of new widths and decodes past the graph ladder compile nothing."""
    triton = pytest.importorskip("triton")
    compiled = []
    path = tiny_model_dirs["llama"]
    with _llm(path, dtype="bfloat16", max_batch_size=32, cuda_graph_config={"batch_sizes": [1, 2, 4]}) as llm:
        previous = triton.knobs.runtime.jit_post_compile_hook
        triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("fn"))
        try:
            for batch, length in [(1, 5), (3, 16), (16, 33), (17, 256), (32, 300)]:
                prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 1 for j in range(length)])
                           for i in range(batch)]
                llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        finally:
            triton.knobs.runtime.jit_post_compile_hook = previous
    assert [getattr(fn, "name", fn) for fn in compiled] == []


def test_graphs_reach_the_engine_max_batch_size_by_default(tiny_model_dirs):
    with _llm(tiny_model_dirs["llama"], dtype="bfloat16", max_batch_size=320) as llm:
        graphs = llm._executor.worker.runner.graphs
        assert graphs.max_batch == 320 and 256 in graphs.batch_sizes
    with _llm(tiny_model_dirs["llama"], dtype="bfloat16", max_batch_size=320,
              cuda_graph_config={"max_batch_size": 64}) as llm:
        assert llm._executor.worker.runner.graphs.max_batch == 64


def test_short_prefills_replay_their_graphs_and_match_eager_prefills(tiny_model_dirs):
    """cuda_graph_config.prefill_max_tokens: steps of at most that many rows replay the prefill graphs (prompts
    admitted beside running decodes too, two requests at a time), with the tokens and log-probabilities of eager
    prefill chunks (0: none captured)."""
    path = tiny_model_dirs["llama"]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    runs = []
    for rows in (0, 128):
        with _llm(path, dtype="float32", max_batch_size=2, cuda_graph_config={"prefill_max_tokens": rows}) as llm:
            runner = llm._executor.worker.runner
            if not rows:
                assert runner.prefill_graphs is None and runner.graph_prefill_rows == 0
                runs.append(_run(llm, params))
                continue
            assert runner.prefill_graphs.batch_sizes == [16, 32, 64, 128] and runner.graph_prefill_rows == 128
            replays = _count_rows(runner.prefill_graphs)
            runs.append(_run(llm, params))
    assert len(replays) >= 3 and max(replays) > 2  # every prompt as rows, some beside decodes
    for eager, graphed in zip(*runs):
        assert graphed.outputs[0].token_ids == eager.outputs[0].token_ids
        assert graphed.outputs[0].cumulative_logprob == pytest.approx(eager.outputs[0].cumulative_logprob, abs=1e-3)
        for got, expected in zip(graphed.prompt_logprobs[1:], eager.prompt_logprobs[1:]):
            token = next(iter(expected))
            assert got[token].logprob == pytest.approx(expected[token].logprob, abs=1e-3)


def _count_rows(graphs) -> list[int]:
    """Each replay's rows, as graphs.run_step is called from now on."""
    rows: list[int] = []
    run_step = graphs.run_step

    def counted(input_ids, *args, **kwargs):
        rows.append(len(input_ids))
        return run_step(input_ids, *args, **kwargs)

    graphs.run_step = counted
    return rows
