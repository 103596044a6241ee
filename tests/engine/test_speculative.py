"""Speculative decoding by prompt lookup (NGramDecodingConfig): proposals, greedy outputs equal to decoding without
it (batched, preempted, stopped, with log-probabilities, under a grammar), sampled outputs that follow the target
distribution (and the grammar-masked one), and its statistics."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch
from pydantic import ValidationError

from raylm import (
    LLM,
    DraftTargetDecodingConfig,
    GuidedDecodingParams,
    KvCacheConfig,
    NGramDecodingConfig,
    SamplingParams,
)
from raylm.actors.worker import Worker
from raylm.config import LlmArgs
from raylm.engine.request import Sequence
from raylm.engine.speculative import NGramProposer, accepted_length, can_speculate, fit_rows

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick "
        "daft zebras jump!")
COPY_PROMPTS = [f"Repeat this text exactly: {TEXT}\nRepeated text:", f"Copy: {TEXT} {TEXT}\nCopy:",
                "The capital of France is", "List the numbers from 1 to 30, separated by commas:"]


def _proposer(max_draft_len: int = 4, ngram: int = 3) -> NGramProposer:
    return NGramProposer(NGramDecodingConfig(max_draft_len=max_draft_len, max_matching_ngram_size=ngram))


def test_a_proposal_continues_the_latest_earlier_occurrence_of_the_longest_matching_suffix():
    proposer = _proposer()
    seq = Sequence(0, [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3], 13)
    # [2, 3] occurs at 1-2 (then 9) and 6-7 (then 7): the latest wins; no 3-gram [5, 2, 3] occurs before.
    assert proposer.propose(seq, 4) == [7, 8, 5, 2]
    assert proposer.propose(seq, 2) == [7, 8]
    seq.token_ids += [7]  # [2, 3, 7] now matches 3 tokens at 6-8
    assert proposer.propose(seq, 3) == [8, 5, 2]
    assert proposer.propose(Sequence(0, [4, 5, 6], 3), 4) == []  # nothing repeats
    assert proposer.propose(Sequence(0, [5], 1), 4) == []


def test_the_index_a_sequence_keeps_gives_what_a_fresh_lookup_gives():
    proposer = _proposer(max_draft_len=3, ngram=2)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = Sequence(0, tokens[:2], 2)
    for length in range(2, len(tokens)):
        grown.token_ids = tokens[:length]
        assert proposer.propose(grown, 3) == proposer.propose(Sequence(0, tokens[:length], 2), 3)


def test_accepted_length_counts_the_leading_drafts_equal_to_the_draws():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 4, 7, 8]) == 1
    assert accepted_length([5], [4, 5]) == 0


def test_requests_whose_draws_depend_on_earlier_draws_of_the_step_do_not_speculate():
    assert can_speculate(SamplingParams())
    assert can_speculate(SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=2))
    assert not can_speculate(SamplingParams(use_speculative_decoding=False))
    assert not can_speculate(SamplingParams(repetition_penalty=1.2))
    assert not can_speculate(SamplingParams(min_tokens=2, max_tokens=4))
    assert not can_speculate(SamplingParams(n=2, temperature=1.0))
    assert not can_speculate(SamplingParams(use_beam_search=True, n=2))
    with pytest.raises(TypeError, match="use_speculative_decoding must be a bool"):
        SamplingParams(use_speculative_decoding="yes")


def test_the_config_is_validated_and_in_the_serve_schema():
    args = LlmArgs(speculative_config={"decoding_type": "NGram", "max_draft_len": 3})
    assert args.speculative_config == NGramDecodingConfig(max_draft_len=3)
    with pytest.raises(ValidationError, match="max_draft_len"):
        NGramDecodingConfig(max_draft_len=0)
    with pytest.raises(ValidationError, match="decoding_type"):
        LlmArgs(speculative_config={"decoding_type": "Eagle"})
    assert "NGramDecodingConfig" in LlmArgs.model_json_schema()["$defs"]


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of the copy prompts without speculation, with log-probabilities."""
    with LLM(dtype="float32") as llm:
        yield llm.generate(COPY_PROMPTS, SamplingParams(max_tokens=48, logprobs=2))


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_greedy_speculation_gives_the_tokens_and_logprobs_of_decoding_without_it(reference):
    with LLM(dtype="float32", speculative_config=NGramDecodingConfig(max_draft_len=4)) as llm:
        outputs = llm.generate(COPY_PROMPTS, SamplingParams(max_tokens=48, logprobs=2))
        stats = llm.get_stats(timeout=2)
    assert _tokens(outputs) == _tokens(reference)
    for got, expected in zip(outputs, reference):
        for got_step, expected_step in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            assert got_step.keys() == expected_step.keys()
            for token, logprob in expected_step.items():
                assert got_step[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
                assert got_step[token].rank == logprob.rank
    spec = stats[-1]["specDecodingStats"]
    assert spec["totalAcceptedTokens"] > 0.3 * spec["totalDraftTokens"] > 0  # the copy prompts accept many


def test_speculation_under_preemption_and_a_per_request_opt_out_gives_the_same_tokens(reference, monkeypatch):
    # A cache of 160 tokens cannot hold four requests of 10-70 prompt tokens growing by 48: some are preempted and
    # recomputed. Verify steps are held to 7 rows, as the largest decode graph holds them on a GPU: three running
    # requests leave 4 rows to the drafts of those that speculate, up to 6 each unless trimmed.
    monkeypatch.setattr(Worker, "_max_verify_rows", lambda self: 7)
    with LLM(dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=160, tokens_per_block=16),
             speculative_config=NGramDecodingConfig(max_draft_len=6)) as llm:
        params = [SamplingParams(max_tokens=48, logprobs=2, use_speculative_decoding=index % 2 == 0)
                  for index in range(len(COPY_PROMPTS))]
        outputs = llm.generate(COPY_PROMPTS, params)
        stats = llm.get_stats(timeout=2)
    assert _tokens(outputs) == _tokens(reference)
    assert sum(entry["inflightBatchingStats"]["numPausedRequests"] for entry in stats) > 0
    rows = [entry["inflightBatchingStats"]["numGenRequests"] + entry["specDecodingStats"]["numDraftTokens"]
            for entry in stats if entry["specDecodingStats"]["numDraftTokens"]]
    assert rows and max(rows) <= 7


@pytest.mark.parametrize(("drafts", "running", "max_rows", "kept"), [
    ({1: [5, 6, 7], 2: [8, 9]}, 4, 10, {1: 3, 2: 2}),  # fits: untouched
    ({1: [5, 6, 7], 2: [8, 9]}, 4, 7, {1: 2, 2: 1}),  # 3 rows: one each, the one left to the longest
    ({1: [5, 6, 7, 8], 2: [8, 9], 3: [1, 2, 3, 4]}, 3, 10, {1: 3, 2: 2, 3: 2}),
    ({1: [5, 6], 2: [8, 9, 7]}, 4, 5, {2: 1}),  # fewer rows than drafting requests: the longest proposals
    ({1: [5, 6, 7]}, 4, 4, None),  # no room: the step does not speculate
    ({}, 5, 4, None),  # nor with no proposals (their tokens still in flight): the steps stay overlapped
    ({}, 3, 4, {}),
    ({1: [5, 6, 7]}, 4, None, {1: 3}),  # no graphs
])
def test_drafts_are_trimmed_to_the_rows_of_the_largest_decode_graph(drafts, running, max_rows, kept):
    trimmed = fit_rows(drafts, running, max_rows)
    if kept is None:
        assert trimmed is None
        return
    assert {key: len(proposal) for key, proposal in trimmed.items()} == kept
    for key, proposal in trimmed.items():
        assert proposal == drafts[key][: len(proposal)]
    if max_rows is not None:
        assert running + sum(kept.values()) <= max_rows


def test_stops_inside_accepted_drafts_end_the_output_where_decoding_without_them_does():
    params = [SamplingParams(max_tokens=n, stop=stop) for n, stop in ((5, None), (17, None), (48, "lazy"))]
    prompts = COPY_PROMPTS[:3]
    with LLM(dtype="float32") as llm:
        expected = llm.generate(prompts, params)
    with LLM(dtype="float32", speculative_config=NGramDecodingConfig(max_draft_len=8)) as llm:
        got = llm.generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert [len(o.outputs[0].token_ids) for o in got[:2]] == [5, 17]


def test_guided_greedy_speculation_gives_the_tokens_of_guided_decoding_without_it():
    """Structured output with prompt lookup: each verify row is masked after its prefix of the drafts, so greedy
    outputs equal guided decoding's without speculation (JSON that copies the prompt's, a regex after begin_after,
    a choice), and drafts the grammar refuses are rejected."""
    record = {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "notes": TEXT}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                               "fields": {"type": "array", "items": {"type": "string"}},
                                               "notes": {"type": "string"}},
              "required": ["name", "born", "fields", "notes"], "additionalProperties": False}
    prompts = [f"Repeat this JSON exactly: {json.dumps(record)}\nJSON:", COPY_PROMPTS[1], COPY_PROMPTS[3]]
    params = [SamplingParams(max_tokens=96, logprobs=1, guided_decoding=GuidedDecodingParams(json=schema)),
              SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(regex="[A-Za-z ,.]+",
                                                                                begin_after=" ")),
              SamplingParams(max_tokens=30, guided_decoding=GuidedDecodingParams(regex="([0-9]+, )+[0-9]+"))]
    runs = {}
    for name, config in (("plain", None), ("speculative", NGramDecodingConfig(max_draft_len=5))):
        with LLM(dtype="float32", speculative_config=config) as llm:
            runs[name] = llm.generate(prompts, params)
            if config is not None:
                totals = llm.get_stats(timeout=2)[-1]["specDecodingStats"]
    assert _tokens(runs["speculative"]) == _tokens(runs["plain"])
    json.loads(runs["speculative"][0].outputs[0].text)
    for got, expected in zip(runs["speculative"][0].outputs[0].logprobs, runs["plain"][0].outputs[0].logprobs):
        assert got.keys() == expected.keys()
        assert [got[t].logprob for t in got] == pytest.approx([expected[t].logprob for t in got], abs=1e-4)
    assert 0 < totals["totalAcceptedTokens"] < totals["totalDraftTokens"]


# A Markov chain over four tokens, as a tiny Llama: the attention and MLP outputs are zero, so the residual stream
# is the token's embedding (a scaled basis vector) and the logits depend on the current token alone. From each
# token the chain goes on around the cycle CHAIN[0] -> CHAIN[1] -> ... with probability about 0.6, which is what
# prompt lookup proposes after a prompt that walks the cycle: drafts are accepted about as often as rejected.
CHAIN = [300, 301, 302, 303]
CHAIN_LOGITS = torch.tensor([[0.0, 2.0, 0.5, 0.0], [0.3, 0.0, 2.0, 0.6], [0.2, 0.7, 0.0, 2.0], [2.0, 0.0, 0.9, 0.4]])


@pytest.fixture(scope="module")
def markov_model(tmp_path_factory, tiny_model_dirs):
    """(directory, transition matrix P[a, b] over CHAIN) of the tiny Llama made into a Markov chain."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        for k, token in enumerate(CHAIN):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, k] = 10.0
        # The normalized state of CHAIN[k] is sqrt(hidden) along dimension k; every other token scores -30.
        head = torch.full_like(model.lm_head.weight, 0.0)
        head[:, : len(CHAIN)] = -30.0 / hidden**0.5
        for j, token in enumerate(CHAIN):
            head[token, : len(CHAIN)] = CHAIN_LOGITS[:, j] / hidden**0.5
        model.lm_head.weight.copy_(head)
        logits = model(torch.tensor([CHAIN])).logits[0]  # each position's next-token logits: its own token's row
    transitions = torch.softmax(logits.double(), dim=-1)[:, CHAIN]
    assert transitions.sum(dim=-1).min() > 1 - 1e-9  # the chain stays on its four tokens
    directory = tmp_path_factory.mktemp("markov")
    model.save_pretrained(directory)
    return directory, transitions


# The acceptance rule is the proposers' own; the draft model's run (another 20 s on the CI machine) is slow.
@pytest.mark.parametrize("proposer", ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_sampled_speculation_draws_from_the_target_distribution(markov_model, proposer):
    """Chi-square tests of each output position's token and of consecutive pairs against the chain's exact
    distribution, with speculation (drafts accepted and rejected many times) and without it (the same test's
    control). Accepting every draft, or keeping a draft with any probability but the target's, fails them. The
    draft model is the chain itself, proposing its greedy walk."""
    scipy_stats = pytest.importorskip("scipy.stats")
    directory, transitions = markov_model
    prompt = {"prompt_token_ids": CHAIN * 3 + CHAIN[:2]}
    count, length = 600, 6
    params = [SamplingParams(max_tokens=length, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(count)]
    speculative = (NGramDecodingConfig(max_draft_len=4) if proposer == "ngram"
                   else DraftTargetDecodingConfig(max_draft_len=4, speculative_model=str(directory)))
    runs = {}
    for name, config in (("plain", None), ("speculative", speculative)):
        with LLM(str(directory), dtype="float32", skip_tokenizer_init=True, speculative_config=config) as llm:
            runs[name] = [output.outputs[0].token_ids for output in llm.generate([prompt] * count, params)]
            if config is not None:
                totals = llm.get_stats(timeout=2)[-1]["specDecodingStats"]
    assert count < totals["totalAcceptedTokens"] < totals["totalDraftTokens"] - count
    index = {token: k for k, token in enumerate(CHAIN)}
    for name, outputs in runs.items():
        assert all(len(tokens) == length and set(tokens) <= set(CHAIN) for tokens in outputs)
        state = transitions[index[CHAIN[1]]]  # the distribution of the first output token
        for position in range(length):
            observed = Counter(index[tokens[position]] for tokens in outputs)
            expected = state * count
            p_value = scipy_stats.chisquare([observed[k] for k in range(4)], expected.tolist())[1]
            assert p_value > 1e-3, (name, position, observed, expected)
            if position + 1 < length:  # the pair (this token, the next): the transitions themselves
                pairs = Counter((index[tokens[position]], index[tokens[position + 1]]) for tokens in outputs)
                joint = (state[:, None] * transitions).flatten() * count
                p_value = scipy_stats.chisquare([pairs[(a, b)] for a in range(4) for b in range(4)],
                                                joint.tolist())[1]
                assert p_value > 1e-3, (name, position, pairs)
            state = state @ transitions


def test_greedy_speculation_on_the_chain_gives_the_chain_s_greedy_walk(markov_model):
    directory, _ = markov_model
    prompts = [{"prompt_token_ids": CHAIN * 3 + CHAIN[:n]} for n in range(4)]
    outputs = {}
    for name, config in (("plain", None), ("speculative", NGramDecodingConfig(max_draft_len=3))):
        with LLM(str(directory), dtype="float32", skip_tokenizer_init=True, speculative_config=config) as llm:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10))]
    assert outputs["speculative"] == outputs["plain"]


def test_prometheus_counts_drafts_from_the_engine_s_totals_even_when_iterations_were_dropped():
    from prometheus_client.parser import text_string_to_metric_families

    from raylm.serving.metrics import ServingMetrics

    metrics = ServingMetrics("m")

    def spec(total_drafts: int, total_accepted: int) -> dict:
        return {"specDecodingStats": {"numDraftTokens": 4, "numAcceptedTokens": 2, "totalDraftTokens": total_drafts,
                                      "totalAcceptedTokens": total_accepted}}

    metrics.ingest_iteration_stats([spec(4, 2), spec(8, 3)])
    metrics.ingest_iteration_stats([spec(20, 11)])  # iterations in between never reached the server
    samples = {sample.name: sample.value for family in text_string_to_metric_families(metrics.render().decode())
               for sample in family.samples}
    assert samples["raylm_spec_decode_num_draft_tokens_total"] == 20
    assert samples["raylm_spec_decode_num_accepted_tokens_total"] == 11


# ---------------------------------------------------------------------- a draft model (DraftTargetDecodingConfig)


def test_smollm2_drafting_for_itself_is_accepted_and_gives_the_tokens_and_logprobs_without_it(reference, smollm2_dir):
    config = DraftTargetDecodingConfig(max_draft_len=4, speculative_model=str(smollm2_dir))
    with LLM(dtype="float32", speculative_config=config) as llm:
        outputs = llm.generate(COPY_PROMPTS, SamplingParams(max_tokens=48, logprobs=2))
        spec = llm.get_stats(timeout=2)[-1]["specDecodingStats"]
        assert llm.startup_metrics["model_loader"]["draft_weight_population_seconds"] > 0
    assert _tokens(outputs) == _tokens(reference)
    for got, expected in zip(outputs, reference):
        for got_step, expected_step in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            for token, logprob in expected_step.items():
                assert got_step[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
    assert spec["totalAcceptedTokens"] > 0.9 * spec["totalDraftTokens"] > 0  # the same model: its own greedy walk


@pytest.mark.slow  # ~28 s; preemption under speculation stays in the default suite with prompt lookup
def test_a_random_draft_model_under_preemption_changes_no_token(reference, tiny_model_dirs):
    config = DraftTargetDecodingConfig(max_draft_len=3, speculative_model=str(tiny_model_dirs["llama"]))
    with LLM(dtype="float32", kv_cache_config=KvCacheConfig(max_tokens=160, tokens_per_block=16),
             speculative_config=config) as llm:
        outputs = llm.generate(COPY_PROMPTS, SamplingParams(max_tokens=48, logprobs=2))
        stats = llm.get_stats(timeout=2)
    assert _tokens(outputs) == _tokens(reference)
    assert sum(entry["inflightBatchingStats"]["numPausedRequests"] for entry in stats) > 0
    assert stats[-1]["specDecodingStats"]["totalDraftTokens"] > 0


def test_a_draft_model_with_a_larger_vocabulary_is_refused_by_name(tmp_path, tiny_model_dirs):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dirs["llama"])
    config.vocab_size = 60000
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="speculative_config.speculative_model .* vocabulary of 60000"):
        LLM(str(tiny_model_dirs["llama"]), load_format="dummy", skip_tokenizer_init=True,
            speculative_config=DraftTargetDecodingConfig(speculative_model=str(tmp_path)))


@pytest.mark.slow  # ~31 s; guided speculation stays in the default suite with greedy decoding
def test_sampled_guided_speculation_draws_from_the_grammar_masked_chain(markov_model, tiny_model_dirs):
    """A regex over the chain's first three tokens whose allowed set depends on the position: any of the three at
    even positions of the output, the first two at odd ones. Outputs follow the chain with what the grammar refuses
    masked out (rows renormalized), with speculation and without: a verify row masked as if the drafts before it
    were not there fails this. Prompt lookup keeps proposing tokens the grammar refuses (the prompt walks the whole
    cycle)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    directory, transitions = markov_model
    tokenizer_files = [f for f in tiny_model_dirs["llama"].iterdir() if "token" in f.name or f.name.endswith(".txt")]
    if not tokenizer_files:
        pytest.skip("the tiny models have no tokenizer (the embedded SmolLM2 is not installed)")
    model_dir = directory.parent / "markov-with-tokenizer"
    if not model_dir.exists():
        shutil.copytree(directory, model_dir)
        for file in tokenizer_files:
            shutil.copy(file, model_dir / file.name)
    from transformers import AutoTokenizer

    pieces = [AutoTokenizer.from_pretrained(model_dir).decode([token]) for token in CHAIN[:3]]
    guided = GuidedDecodingParams(regex=f"(({'|'.join(pieces)})({'|'.join(pieces[:2])}))+")
    allowed = {0: transitions[:3, :3], 1: torch.cat([transitions[:3, :2], torch.zeros(3, 1)], dim=1)}
    masked = {parity: rows / rows.sum(dim=-1, keepdim=True) for parity, rows in allowed.items()}
    prompt = {"prompt_token_ids": CHAIN * 3 + CHAIN[:2]}
    count, length = 600, 5
    params = [SamplingParams(max_tokens=length, temperature=1.0, seed=seed, ignore_eos=True, guided_decoding=guided)
              for seed in range(count)]
    runs = {}
    for name, config in (("plain", None), ("speculative", NGramDecodingConfig(max_draft_len=4))):
        with LLM(str(model_dir), dtype="float32", speculative_config=config) as llm:
            runs[name] = [output.outputs[0].token_ids for output in llm.generate([prompt] * count, params)]
            if config is not None:
                totals = llm.get_stats(timeout=2)[-1]["specDecodingStats"]
    assert count < totals["totalAcceptedTokens"] < totals["totalDraftTokens"] - count
    index = {token: k for k, token in enumerate(CHAIN[:3])}
    for name, outputs in runs.items():
        assert all(len(tokens) == length and set(tokens) <= set(CHAIN[:3]) for tokens in outputs), name
        state = masked[0][index[CHAIN[1]]]
        for position in range(length):
            observed = Counter(index[tokens[position]] for tokens in outputs)
            expected = state * count
            support = [k for k in range(3) if expected[k] > 0]
            assert set(observed) <= set(support), (name, position, observed)
            p_value = scipy_stats.chisquare([observed[k] for k in support], expected[support].tolist())[1]
            assert p_value > 1e-3, (name, position, observed, expected)
            step = masked[(position + 1) % 2]
            if position + 1 < length:
                pairs = Counter((index[tokens[position]], index[tokens[position + 1]]) for tokens in outputs)
                joint = (state[:, None] * step).flatten() * count
                cells = [cell for cell in range(9) if joint[cell] > 0]
                assert {3 * a + b for a, b in pairs} <= set(cells), (name, position, pairs)
                p_value = scipy_stats.chisquare([pairs[divmod(cell, 3)] for cell in cells], joint[cells].tolist())[1]
                assert p_value > 1e-3, (name, position, pairs)
            state = state @ step
