"""Decode graphs compute their rows' logits, and for steps of greedy requests their greedy draws, on the device
(cuda_graphs.DecodeOutputs): the runner takes those logits instead of launching the LM head, and a batch of plain
greedy rows takes the draws instead of sampling. On the CPU a stand-in replays nothing: it runs the eager decode
and returns what a replay returns."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raylm import LLM, KvCacheConfig, SamplingParams, TokensPrompt
from raylm.engine.cuda_graphs import DecodeOutputs
from raylm.engine.sampler import Sampler, SamplingRow, greedy_draws
from raylm.engine.step_plan import StepPlan
from tests.engine.test_overlap import PROMPTS, _mixed_params, _summary


class _EagerGraphs:
    """DecodeGraphs' interface over the runner's eager forward. As the runner's decode graphs (`graphs`): every
    decode step fits, with its logits and greedy draws. As its prefill graphs (`prefill_graphs`): steps of at most
    `max_batch` rows whose prompt tokens come as rows of their own (verify rows), hidden states only."""

    captured = False  # steps prepare their LoRA rows as eager ones do

    def __init__(self, runner, attribute: str = "graphs", max_batch: int | None = None):
        self.runner = runner
        self.attribute = attribute
        self.max_batch = max_batch
        self.takes_verify_rows = attribute == "prefill_graphs"
        self.steps = 0
        self.greedy_steps = 0
        self.rows: list[int] = []  # each step's rows

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return self.max_batch is None or num_seqs <= self.max_batch

    def free(self) -> None:  # nothing of its own on a device
        self.runner = None

    def run_step(self, input_ids, positions, slot_mapping, contexts, feed=None, greedy=False,
                 lora_slots=None) -> DecodeOutputs:
        self.steps += 1
        self.greedy_steps += greedy
        self.rows.append(len(input_ids))
        runner = self.runner
        setattr(runner, self.attribute, None)
        try:
            plan = StepPlan(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                            decode_contexts=contexts, verify_rows=self.takes_verify_rows)
            hidden = runner.forward(plan, feed=feed)
        finally:
            setattr(runner, self.attribute, self)
        if self.takes_verify_rows:
            return DecodeOutputs(hidden)
        logits = runner.model.compute_logits(hidden)
        return DecodeOutputs(hidden, logits, greedy_draws(logits) if greedy else None)


def _llm(path) -> LLM:
    kv = KvCacheConfig(max_tokens=2048, tokens_per_block=4, enable_block_reuse=True)
    return LLM(str(path), skip_tokenizer_init=True, kv_cache_config=kv, max_seq_len=256)


def _outputs(path, graphed: bool):
    """Outputs of mixed sampling settings, then of a plain greedy batch, whose steps are spied on: whether each
    draw was the graph's, and each LM head launched (its rows)."""
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    with _llm(path) as llm:
        runner = llm._executor.worker.runner
        if graphed:
            runner.graphs = _EagerGraphs(runner)
        eos = llm.info.vocab_size - 1
        mixed = _summary(llm.generate(prompts, _mixed_params(eos), use_tqdm=False))
        if graphed:  # sampled rows: no step asks the graphs for greedy draws
            greedy_before = runner.graphs.greedy_steps
            llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.8), use_tqdm=False)
            assert runner.graphs.greedy_steps == greedy_before

        taken, lm_head_calls = [], []
        sample, compute_logits = runner.sampler.sample, runner.model.compute_logits

        def spy_sample(logits, rows, greedy=None):
            pending = sample(logits, rows, greedy)
            taken.append(greedy is not None and pending.tokens is greedy[0])
            return pending

        def spy_logits(hidden):
            lm_head_calls.append(hidden.shape[0])
            return compute_logits(hidden)

        runner.sampler.sample, runner.model.compute_logits = spy_sample, spy_logits
        before = runner.graphs.steps if graphed else 0
        plain = _summary(llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False))
        served = runner.graphs.steps - before if graphed else 0
        runner.sampler.sample, runner.model.compute_logits = sample, compute_logits
    return (mixed, plain), taken, lm_head_calls, served


def test_graph_logits_and_greedy_draws_give_exactly_the_eager_outputs(tiny_model_dirs):
    """Mixed sampling settings (greedy with logprobs, seeded n=2, penalties, min_tokens, beam search) and plain
    greedy batches: the same tokens, logprobs and stops with the graphs' outputs as without them; the plain
    greedy steps return the graphs' draws themselves and never launch the LM head after the graph."""
    path = tiny_model_dirs["llama"]
    eager, taken, lm_head_calls, _ = _outputs(path, graphed=False)
    assert not any(taken) and len(lm_head_calls) == len(taken)
    graphed, taken, lm_head_calls, served = _outputs(path, graphed=True)
    assert graphed == eager
    assert served >= 11 and sum(taken) == served  # 12 tokens: every decode step took the graph's draws
    assert len(lm_head_calls) == len(taken)  # one LM head a step: inside the stand-in for decode steps


def test_the_sampler_takes_precomputed_greedy_draws_only_for_plain_greedy_rows():
    """Bit for bit the draws it would make; rows that report ranks, draw n > 1, penalise or sample ignore them."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    draws = greedy_draws(logits)
    sampler = Sampler(seed=0)

    def rows(**params) -> list[SamplingRow]:
        return [SamplingRow(SamplingParams(max_tokens=4, **params), [1, 2], [3]) for _ in range(3)]

    plain = sampler.sample(logits, rows(), draws)
    assert plain.tokens is draws[0]
    assert [r.token_ids for r in plain.results()] == [r.token_ids for r in sampler.sample(logits, rows()).results()]
    assert [r.logprobs for r in plain.results()] == [r.logprobs for r in sampler.sample(logits, rows()).results()]
    for params in ({"logprobs": 1}, {"repetition_penalty": 1.5}, {"temperature": 0.7, "seed": 1}, {"min_tokens": 2}):
        assert sampler.sample(logits, rows(**params), draws).tokens is not draws[0], params


def test_leading_rows_are_a_slice_and_others_an_index():
    """A step that feeds every row of the one before, in order, copies no index to the device."""
    from raylm.engine.sampler import put_rows, row_index, take_rows

    cpu = torch.device("cpu")
    source = torch.arange(10, 16)
    assert row_index([0, 1, 2], cpu) == 3
    assert take_rows(source, 3).data_ptr() == source.data_ptr()  # a view
    shuffled = row_index([2, 0, 1], cpu)
    assert shuffled.tolist() == [2, 0, 1] and take_rows(source, shuffled).tolist() == [12, 10, 11]
    assert row_index([1, 2], cpu).tolist() == [1, 2] and row_index([0, 2], cpu).tolist() == [0, 2]
    target = torch.zeros(6, dtype=torch.long)
    put_rows(target, 2, torch.tensor([7, 8]))
    put_rows(target, row_index([5, 3], cpu), torch.tensor([9, 4]))
    assert target.tolist() == [7, 8, 0, 4, 0, 9]


def test_kv_capacity_leaves_room_for_the_graphs_logits(tiny_model_dirs, monkeypatch):
    """The decode graphs keep the largest batch's logits twice in the model's dtype and once in float32 for good:
    the KV budget subtracts that, and nothing where no graph computes logits."""
    from tests.kernels import tiny_runner

    runner, loaded = tiny_runner(tiny_model_dirs["llama"], torch.float32, torch.device("cpu"))
    assert runner.graph_logits_bytes(64, pp_size=1) == 0  # the torch attention path captures no graphs
    runner.attention_backend = "triton"
    assert runner.graph_logits_bytes(64, pp_size=1) == 64 * loaded.arch.vocab_size * (2 * 4 + 4)
    assert runner.graph_logits_bytes(64, pp_size=2) == 0  # pipeline stages run eagerly
    runner.capture_logits = False  # cuda_graph_config.capture_logits
    assert runner.graph_logits_bytes(64, pp_size=1) == 0


def test_short_prompts_through_the_prefill_graphs_give_the_eager_outputs(tiny_model_dirs):
    """Prompts as rows of their own (plan_step's graph_rows), alone and beside decodes of requests admitted
    earlier (three at a time), with mixed sampling settings and prompt log-probabilities: the same tokens, stops
    and log-probabilities as their prefill chunks give; steps of more rows than the largest graph (the first: 43
    prompt tokens) stay eager, never reaching the graphs."""
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]

    def run(prefill_graphs: bool):
        kv = KvCacheConfig(max_tokens=2048, tokens_per_block=4, enable_block_reuse=False)
        with LLM(str(tiny_model_dirs["llama"]), skip_tokenizer_init=True, kv_cache_config=kv, max_seq_len=256,
                 max_batch_size=3) as llm:
            runner = llm._executor.worker.runner
            graphs = runner.prefill_graphs = _EagerGraphs(runner, "prefill_graphs", 40) if prefill_graphs else None
            eos = llm.info.vocab_size - 1
            params = [dataclasses.replace(p, prompt_logprobs=1) for p in _mixed_params(eos)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, graphs

    eager, _ = run(False)
    graphed, graphs = run(True)
    assert max(graphs.rows) > 3 and max(graphs.rows) <= 40  # prompts' rows went through the stand-in
    for got, expected in zip(graphed, eager):
        for got_logprob, expected_logprob in zip(got.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
            token, entry = next(iter(expected_logprob.items()))  # the prompt's own token
            assert got_logprob[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
        for got_choice, expected_choice in zip(got.outputs, expected.outputs):
            assert (got_choice.token_ids, got_choice.finish_reason) == (expected_choice.token_ids,
                                                                        expected_choice.finish_reason)
            for got_step, expected_step in zip(got_choice.logprobs or [], expected_choice.logprobs or []):
                assert got_step.keys() == expected_step.keys()
                for token, entry in expected_step.items():
                    assert got_step[token].logprob == pytest.approx(entry.logprob, abs=1e-4)
