"""Sampler: draws follow the filtered, renormalised distribution; greedy is argmax; penalties, min_tokens,
seeds, logprobs and beam candidates behave as documented.

Distribution tests draw 20,000 tokens with fixed seeds and compare the counts with the expected
probabilities computed here independently of raylm: every token must be within five standard errors of
its expected count, and the chi-square statistic below its 1e-4 critical value, so a wrong distribution
fails (test_distribution_check_rejects_* prove the check has that power).

Every test runs on the CPU and, where CUDA is, again with the logits on the GPU (marked `gpu`): the sampler
draws where its logits are, as the engine's does on a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from raylm.engine.sampler import Sampler, SampleResult, SamplingRow, apply_penalties, filter_logits
from raylm.sampling_params import SamplingParams

LOGITS = [2.0, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -2.5]  # distinct, descending: token i is the (i+1)-th best
VOCAB = len(LOGITS)
NUM_DRAWS = 20_000
EOS = 2
DEVICE = torch.device("cpu")  # where the tests put logits: set per test by the `device` fixture


# ------------------------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def device(request):
    global DEVICE
    DEVICE = torch.device(request.param)
    yield DEVICE
    DEVICE = torch.device("cpu")


def _tensor(values, **kwargs) -> torch.Tensor:
    """Logits on the test's device."""
    return torch.tensor(values, device=DEVICE, **kwargs)


def _softmax(values: list[float]) -> list[float]:
    top = max(v for v in values if v != -math.inf)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def _renormalise(probs: list[float], keep: set[int]) -> list[float]:
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


def _reference_probs(logits: list[float], temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None, min_p: float | None = None) -> list[float]:
    """The documented pipeline, written out plainly: temperature, then top-k, top-p, min-p, renormalising."""
    probs = _softmax([v / temperature for v in logits])
    keep = {i for i, p in enumerate(probs) if p > 0.0}
    if top_k:
        keep = set(sorted(keep, key=lambda i: -probs[i])[:top_k])
    probs = _renormalise(probs, keep)
    if top_p is not None:
        nucleus, mass = set(), 0.0
        for i in sorted(keep, key=lambda i: -probs[i]):
            nucleus.add(i)
            mass += probs[i]
            if mass >= top_p:
                break
        keep = nucleus
    probs = _renormalise(probs, keep)
    if min_p is not None:
        floor = min_p * max(probs)
        keep = {i for i in keep if probs[i] >= floor}
    return _renormalise(probs, keep)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of chi-square (z = 3.719: tail 1e-4), by the Wilson-Hilferty approximation."""
    return df * (1.0 - 2.0 / (9.0 * df) + z * math.sqrt(2.0 / (9.0 * df))) ** 3


def _assert_draws_follow(tokens: list[int], expected: list[float]) -> None:
    """Fails unless the drawn tokens are a plausible sample of `expected` (zero-probability tokens never)."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"token {token} has probability 0 but was drawn {count} times"
            continue
        mean, std_err = n * p, math.sqrt(n * p * (1.0 - p))
        assert abs(count - mean) <= 5.0 * std_err + 1e-9, f"token {token}: drawn {count}, expected {mean:.0f}"
    # Pool cells expecting fewer than 5 draws, where the chi-square approximation is poor.
    cells, pooled_count, pooled_mean = [], 0, 0.0
    for count, p in zip(counts, expected):
        if p == 0.0:
            continue
        if n * p < 5:
            pooled_count, pooled_mean = pooled_count + count, pooled_mean + n * p
        else:
            cells.append((count, n * p))
    if pooled_mean > 0.0:
        cells.append((pooled_count, pooled_mean))
    if len(cells) > 1:
        statistic = sum((count - mean) ** 2 / mean for count, mean in cells)
        assert statistic <= _chi2_critical(len(cells) - 1), f"chi-square {statistic:.1f} over {len(cells)} cells"


def _row(params: SamplingParams, seed: int | None = None, num_samples: int = 1, prompt: list[int] | None = None,
         output: list[int] | None = None) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, list(prompt or []), list(output or []), generator, num_samples)


def _sample(rows: list[SamplingRow], logits: list[list[float]] | None = None, sampler_seed: int = 0
            ) -> list[SampleResult]:
    batch = _tensor(logits if logits is not None else [LOGITS] * len(rows))
    return Sampler(sampler_seed)(batch, rows)


def _draw_many(params: SamplingParams, seed: int = 1234, logits: list[float] = LOGITS, **row_kwargs) -> list[int]:
    [result] = _sample([_row(params, seed, NUM_DRAWS, **row_kwargs)], [logits])
    assert len(result.token_ids) == NUM_DRAWS
    return result.token_ids


def _with_eos(**kwargs) -> SamplingParams:
    return dataclasses.replace(SamplingParams(**kwargs), _eos_token_ids=(EOS,))


RAW_LOGPROBS = torch.log_softmax(torch.tensor(LOGITS), dim=-1).tolist()


# ------------------------------------------------------------------------------------------- the check itself


def test_distribution_check_rejects_draws_at_the_wrong_temperature():
    tokens = _draw_many(SamplingParams(temperature=2.0))
    with pytest.raises(AssertionError):
        _assert_draws_follow(tokens, _reference_probs(LOGITS, temperature=1.0))


def test_distribution_check_rejects_draws_at_a_slightly_wrong_temperature():
    tokens = _draw_many(SamplingParams(temperature=1.1))
    with pytest.raises(AssertionError):
        _assert_draws_follow(tokens, _reference_probs(LOGITS, temperature=1.0))


def test_distribution_check_rejects_unfiltered_draws_when_a_filter_is_expected():
    tokens = _draw_many(SamplingParams(temperature=1.0))
    with pytest.raises(AssertionError, match="has probability 0"):
        _assert_draws_follow(tokens, _reference_probs(LOGITS, top_k=7))


def test_reference_filters_each_remove_tokens_in_the_combined_case():
    # Guards the combination test below: each filter must bite, or that test would not cover it.
    assert _reference_probs(LOGITS, 1.5, top_k=6).count(0.0) == 2
    assert _reference_probs(LOGITS, 1.5, top_k=6, top_p=0.8).count(0.0) == 4
    assert _reference_probs(LOGITS, 1.5, top_k=6, top_p=0.8, min_p=0.4).count(0.0) == 5


# ------------------------------------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 3.7])
def test_temperature_sampling_follows_softmax_of_logits_over_temperature(temperature):
    tokens = _draw_many(SamplingParams(temperature=temperature))
    _assert_draws_follow(tokens, _reference_probs(LOGITS, temperature=temperature))


def test_sampling_without_temperature_uses_temperature_one():
    tokens = _draw_many(SamplingParams(top_p=1.0))
    _assert_draws_follow(tokens, _reference_probs(LOGITS, temperature=1.0))


@pytest.mark.parametrize("top_k", [2, 3, 5, 7])
def test_top_k_keeps_exactly_the_k_most_likely_tokens_renormalised(top_k):
    tokens = _draw_many(SamplingParams(temperature=1.0, top_k=top_k))
    assert set(tokens) == set(range(top_k))
    _assert_draws_follow(tokens, _reference_probs(LOGITS, top_k=top_k))


@pytest.mark.parametrize("top_k", [0, VOCAB, VOCAB + 5])
def test_top_k_zero_or_at_least_vocab_keeps_every_token(top_k):
    tokens = _draw_many(SamplingParams(temperature=2.0, top_k=top_k))
    assert set(tokens) == set(range(VOCAB))
    _assert_draws_follow(tokens, _reference_probs(LOGITS, temperature=2.0))


@pytest.mark.parametrize(("top_p", "nucleus_size"), [(0.3, 1), (0.5, 2), (0.8, 4), (0.95, 6)])
def test_top_p_keeps_the_smallest_nucleus_reaching_p_renormalised(top_p, nucleus_size):
    tokens = _draw_many(SamplingParams(temperature=1.0, top_p=top_p))
    expected = _reference_probs(LOGITS, top_p=top_p)
    assert [p > 0 for p in expected] == [i < nucleus_size for i in range(VOCAB)]
    assert set(tokens) == set(range(nucleus_size))
    _assert_draws_follow(tokens, expected)


def test_top_p_nucleus_is_computed_after_temperature():
    # At T = 2 the distribution is flatter, so p = 0.8 needs 5 tokens instead of 4 at T = 1.
    tokens = _draw_many(SamplingParams(temperature=2.0, top_p=0.8))
    expected = _reference_probs(LOGITS, temperature=2.0, top_p=0.8)
    assert sum(p > 0 for p in expected) == 5
    _assert_draws_follow(tokens, expected)


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, 4), (0.3, 3), (0.5, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_min_p_times_the_max_probability(min_p, kept):
    tokens = _draw_many(SamplingParams(temperature=1.0, min_p=min_p))
    expected = _reference_probs(LOGITS, min_p=min_p)
    assert [p > 0 for p in expected] == [i < kept for i in range(VOCAB)]
    _assert_draws_follow(tokens, expected)


def test_temperature_top_k_top_p_and_min_p_combine_in_that_order():
    params = SamplingParams(temperature=1.5, top_k=6, top_p=0.8, min_p=0.4)
    tokens = _draw_many(params)
    assert set(tokens) == {0, 1, 2}
    _assert_draws_follow(tokens, _reference_probs(LOGITS, 1.5, top_k=6, top_p=0.8, min_p=0.4))


def test_top_k_and_top_p_combine_with_top_p_over_the_renormalised_top_k():
    # Over the top 3 renormalised (0.56, 0.25, 0.19), p = 0.75 needs 2 tokens; over the full vocab it needs 3.
    tokens = _draw_many(SamplingParams(temperature=1.0, top_k=3, top_p=0.75))
    expected = _reference_probs(LOGITS, top_k=3, top_p=0.75)
    assert sum(p > 0 for p in expected) == 2
    _assert_draws_follow(tokens, expected)


def test_sampling_with_penalties_follows_softmax_of_the_penalised_logits():
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    prompt, output = [0, 6], [1, 1, 3]
    tokens = _draw_many(params, prompt=prompt, output=output)
    penalised = list(LOGITS)
    for token in {0, 6, 1, 3}:
        penalised[token] = penalised[token] / 2.0 if penalised[token] > 0 else penalised[token] * 2.0
    for token in {1, 3}:
        penalised[token] -= 0.5 + 0.25 * output.count(token)
    _assert_draws_follow(tokens, _reference_probs(penalised))


def test_sampling_before_min_tokens_never_draws_stop_ids_and_renormalises_the_rest():
    params = _with_eos(temperature=1.0, min_tokens=3, stop_token_ids=[0])
    tokens = _draw_many(params, output=[5, 5])
    masked = [-math.inf if token in (0, EOS) else value for token, value in enumerate(LOGITS)]
    _assert_draws_follow(tokens, _reference_probs(masked))


def test_sampling_in_a_batch_row_follows_that_rows_own_logits():
    other = [-v for v in LOGITS]
    rows = [_row(SamplingParams(temperature=1.0), seed=5, num_samples=NUM_DRAWS),
            _row(SamplingParams(temperature=1.0, top_k=3), seed=6, num_samples=NUM_DRAWS)]
    first, second = _sample(rows, [LOGITS, other])
    _assert_draws_follow(first.token_ids, _reference_probs(LOGITS))
    _assert_draws_follow(second.token_ids, _reference_probs(other, top_k=3))


# ------------------------------------------------------------------------------------------- filter_logits


def test_filter_logits_top_k_masks_all_but_the_k_largest():
    logits = _tensor([0.3, 2.0, -1.0, 1.5, 0.0])
    filtered = filter_logits(logits, top_k=2, top_p=None, min_p=None)
    assert torch.isinf(filtered).tolist() == [True, False, True, False, True]
    assert filtered[1] == 2.0 and filtered[3] == 1.5


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(None, None, None), (0, 1.0, 0.0), (VOCAB, None, None)])
def test_filter_logits_disabled_filters_leave_logits_unchanged(top_k, top_p, min_p):
    logits = _tensor(LOGITS)
    assert torch.equal(filter_logits(logits, top_k, top_p, min_p), logits)


def test_filter_logits_does_not_modify_its_input():
    logits = _tensor(LOGITS)
    filter_logits(logits, top_k=2, top_p=0.5, min_p=0.5)
    assert torch.equal(logits, _tensor(LOGITS))


def test_filter_logits_top_p_keeps_the_top_token_even_when_it_alone_exceeds_p():
    filtered = filter_logits(_tensor([5.0, 0.0, 0.0]), top_k=None, top_p=0.1, min_p=None)
    assert torch.isfinite(filtered).tolist() == [True, False, False]


def test_filter_logits_filters_each_row_of_a_batch_independently():
    batch = _tensor([LOGITS, list(reversed(LOGITS))])
    filtered = filter_logits(batch, top_k=3, top_p=None, min_p=None)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == [0, 1, 2]
    assert torch.isfinite(filtered[1]).nonzero().flatten().tolist() == [5, 6, 7]
    filtered = filter_logits(batch, top_k=None, top_p=0.8, min_p=None)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert torch.isfinite(filtered[1]).nonzero().flatten().tolist() == [4, 5, 6, 7]
    filtered = filter_logits(batch, top_k=None, top_p=None, min_p=0.3)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == [0, 1, 2]
    assert torch.isfinite(filtered[1]).nonzero().flatten().tolist() == [5, 6, 7]


def test_filter_logits_keeps_surviving_logits_unchanged():
    logits = _tensor(LOGITS)
    filtered = filter_logits(logits, top_k=5, top_p=0.9, min_p=0.1)
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])


# ------------------------------------------------------------------------------------------- greedy


def test_greedy_default_params_pick_the_argmax_of_each_row():
    logits = [LOGITS, list(reversed(LOGITS)), [0.0, 0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    results = _sample([_row(SamplingParams()) for _ in logits], logits)
    assert [r.token_ids for r in results] == [[0], [7], [2]]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(top_k=1),
                                    SamplingParams(temperature=5.0, top_k=1)], ids=str)
def test_greedy_params_always_pick_the_argmax_whatever_the_seed(params):
    logits = [0.0, 1.0, 0.99, 0.98, 0.0, 0.0, 0.0, 0.0]
    for seed in range(5):
        [result] = _sample([_row(params, seed=seed, num_samples=20)], [logits], sampler_seed=seed)
        assert result.token_ids == [1] * 20


def test_greedy_with_num_samples_repeats_the_argmax():
    [result] = _sample([_row(SamplingParams(logprobs=2), num_samples=3)])
    assert result.token_ids == [0, 0, 0]
    assert result.ranks == [1, 1, 1]
    assert result.logprobs == pytest.approx([RAW_LOGPROBS[0]] * 3)
    assert len(result.top_ids) == 3


def test_greedy_picks_the_argmax_after_penalties():
    [result] = _sample([_row(SamplingParams(repetition_penalty=10.0), output=[0])])
    assert result.token_ids == [1]


# ------------------------------------------------------------------------------------------- penalties


def _penalised(params: SamplingParams, prompt: list[int], output: list[int],
               logits: list[float] = LOGITS) -> list[float]:
    values = _tensor(logits)
    apply_penalties(values, params, prompt, output)
    return values.tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    got = _penalised(SamplingParams(repetition_penalty=2.0), prompt=[0, 6], output=[1, 5])
    expected = [1.0, 0.6, 0.9, 0.5, 0.1, -0.6, -2.0, -2.5]
    assert got == pytest.approx(expected)


def test_repetition_penalty_below_one_raises_seen_positive_logits():
    got = _penalised(SamplingParams(repetition_penalty=0.5), prompt=[], output=[0, 7])
    assert got == pytest.approx([4.0, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -1.25])


def test_repetition_penalty_applies_once_however_often_a_token_repeats():
    got = _penalised(SamplingParams(repetition_penalty=2.0), prompt=[3, 3, 3], output=[3, 3])
    assert got[3] == pytest.approx(0.25)
    assert [v for i, v in enumerate(got) if i != 3] == pytest.approx([v for i, v in enumerate(LOGITS) if i != 3])


def test_repetition_penalty_leaves_zero_logits_at_zero():
    got = _penalised(SamplingParams(repetition_penalty=3.0), prompt=[0], output=[], logits=[0.0, 1.0])
    assert got == [0.0, 1.0]


def test_presence_penalty_subtracts_a_constant_for_tokens_in_the_output_only():
    got = _penalised(SamplingParams(presence_penalty=0.5), prompt=[4, 5], output=[0, 0, 0, 2])
    expected = list(LOGITS)
    expected[0] -= 0.5
    expected[2] -= 0.5
    assert got == pytest.approx(expected)


def test_frequency_penalty_subtracts_count_times_penalty_for_output_tokens_only():
    got = _penalised(SamplingParams(frequency_penalty=0.25), prompt=[4, 4], output=[0, 0, 0, 2, 7, 0])
    expected = list(LOGITS)
    expected[0] -= 4 * 0.25
    expected[2] -= 1 * 0.25
    expected[7] -= 1 * 0.25
    assert got == pytest.approx(expected)


def test_negative_presence_and_frequency_penalties_raise_repeated_tokens():
    got = _penalised(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), prompt=[], output=[6, 6])
    expected = list(LOGITS)
    expected[6] += 1.0 + 2 * 0.5
    assert got == pytest.approx(expected)


def test_repetition_then_presence_and_frequency_penalties_combine():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = _penalised(params, prompt=[0], output=[1, 1, 6])
    expected = list(LOGITS)
    expected[0] = 2.0 / 2.0
    expected[1] = 1.2 / 2.0 - 0.5 - 2 * 0.25
    expected[6] = -1.0 * 2.0 - 0.5 - 0.25
    assert got == pytest.approx(expected)


def test_neutral_penalties_change_nothing():
    assert _penalised(SamplingParams(), prompt=[0, 1], output=[2, 2]) == _tensor(LOGITS).tolist()


def test_sampler_does_not_modify_the_callers_logits():
    logits = _tensor([LOGITS])
    params = _with_eos(temperature=1.0, repetition_penalty=3.0, presence_penalty=1.0, min_tokens=4)
    Sampler(0)(logits, [_row(params, seed=0, prompt=[0], output=[1])])
    assert torch.equal(logits, _tensor([LOGITS]))


# ------------------------------------------------------------------------------------------- min_tokens


def _greedy_choice(params: SamplingParams, output: list[int], logits: list[float]) -> int:
    [result] = _sample([_row(params, output=output)], [logits])
    return result.token_ids[0]


EOS_FIRST = [0.0, 0.5, 9.0, 8.0, 0.0, 0.0, 0.0, 0.0]  # eos (2) is the argmax, token 3 the runner-up


def test_min_tokens_masks_eos_until_that_many_tokens_are_out():
    params = _with_eos(min_tokens=3)
    assert _greedy_choice(params, [], EOS_FIRST) == 3
    assert _greedy_choice(params, [5, 5], EOS_FIRST) == 3
    assert _greedy_choice(params, [5, 5, 5], EOS_FIRST) == EOS


def test_min_tokens_masks_stop_token_ids_too():
    params = _with_eos(min_tokens=2, stop_token_ids=[3])
    assert _greedy_choice(params, [], EOS_FIRST) == 1
    assert _greedy_choice(params, [7, 7], EOS_FIRST) == EOS


def test_min_tokens_with_ignore_eos_masks_only_stop_token_ids():
    params = _with_eos(min_tokens=2, stop_token_ids=[3], ignore_eos=True)
    assert _greedy_choice(params, [], EOS_FIRST) == EOS
    assert _greedy_choice(params, [], [0.0, 0.5, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0]) == 2


def test_min_tokens_masks_end_id_instead_of_the_tokenizer_eos():
    params = _with_eos(min_tokens=2, end_id=3)
    assert _greedy_choice(params, [], EOS_FIRST) == EOS
    assert _greedy_choice(params, [], [0.0, 0.5, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0]) == 2


def test_min_tokens_zero_masks_nothing():
    assert _greedy_choice(_with_eos(), [], EOS_FIRST) == EOS


# ------------------------------------------------------------------------------------------- seeds


SAMPLING = SamplingParams(temperature=1.0)


def _seeded_tokens(seed: int, sampler_seed: int = 0, params: SamplingParams = SAMPLING) -> list[int]:
    [result] = _sample([_row(params, seed=seed, num_samples=64)], sampler_seed=sampler_seed)
    return result.token_ids


def test_same_seed_gives_the_same_tokens_whatever_the_sampler_seed():
    assert _seeded_tokens(42, sampler_seed=0) == _seeded_tokens(42, sampler_seed=999)


def test_different_seeds_give_different_tokens():
    assert _seeded_tokens(42) != _seeded_tokens(43)


def test_unseeded_rows_are_reproducible_from_the_sampler_seed():
    def tokens(sampler_seed: int) -> list[int]:
        return _sample([_row(SAMPLING, num_samples=64)], sampler_seed=sampler_seed)[0].token_ids

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)


def test_seeded_row_draws_do_not_depend_on_the_other_rows_in_the_batch():
    params = SamplingParams(temperature=0.9, top_k=6)

    def run(batch_before: int, batch_after: int) -> list[list[int]]:
        seeded = _row(params, seed=2024)
        others = [SamplingRow(SamplingParams(temperature=1.0), [], [], None, 3),
                  _row(SamplingParams(temperature=0.5, top_p=0.9), seed=1),
                  _row(SamplingParams()),
                  _row(SamplingParams(temperature=2.0), seed=2024, num_samples=5)]
        rows = others[:batch_before] + [seeded] + others[len(others) - batch_after:]
        sampler = Sampler(batch_before * 10 + batch_after)
        steps = []
        for _ in range(30):  # successive steps: the row's generator carries its state across calls
            results = sampler(_tensor([LOGITS] * len(rows)), rows)
            steps.append(results[batch_before].token_ids[0])
        return steps

    alone = run(0, 0)
    assert len(set(alone)) > 1
    assert run(2, 0) == alone
    assert run(0, 3) == alone
    assert run(4, 4) == alone


# ------------------------------------------------------------------------------------------- num_samples


def test_num_samples_draws_that_many_tokens_each_with_its_logprob_and_rank():
    [result] = _sample([_row(SamplingParams(temperature=2.0, logprobs=3), seed=3, num_samples=50)])
    assert len(result.token_ids) == len(result.logprobs) == len(result.ranks) == 50
    assert len(result.top_ids) == len(result.top_logprobs) == 50
    assert len(set(result.token_ids)) > 1
    for token, logprob, rank in zip(result.token_ids, result.logprobs, result.ranks):
        assert logprob == pytest.approx(RAW_LOGPROBS[token])
        assert rank == token + 1  # LOGITS are descending


def test_num_samples_draws_are_independent_not_copies():
    [result] = _sample([_row(SamplingParams(temperature=1.0), seed=11, num_samples=NUM_DRAWS)])
    _assert_draws_follow(result.token_ids, _reference_probs(LOGITS))
    first, second = result.token_ids[0::2], result.token_ids[1::2]
    agreement = sum(a == b for a, b in zip(first, second)) / len(first)
    expected_agreement = sum(p * p for p in _reference_probs(LOGITS))
    assert agreement == pytest.approx(expected_agreement, abs=0.02)


# ------------------------------------------------------------------------------------------- logprobs


def test_reported_logprobs_are_the_raw_log_softmax_before_penalties_and_temperature():
    params = SamplingParams(temperature=0.3, repetition_penalty=5.0, presence_penalty=2.0, logprobs=4)
    [result] = _sample([_row(params, seed=9, num_samples=200, prompt=[0], output=[0, 1])])
    assert {0, 1} - set(result.token_ids)  # the penalties do push the sampler off the penalised tokens
    for token, logprob in zip(result.token_ids, result.logprobs):
        assert logprob == pytest.approx(RAW_LOGPROBS[token])
    assert result.top_logprobs[0] == pytest.approx(sorted(RAW_LOGPROBS, reverse=True)[:4])


def test_rank_is_one_for_the_argmax_and_one_plus_the_better_tokens_otherwise():
    logits = [0.1, 3.0, -2.0, 1.0, 0.5, 2.0, -1.0, 0.0]
    by_rank = sorted(range(VOCAB), key=lambda i: -logits[i])
    [result] = _sample([_row(SamplingParams(temperature=5.0, logprobs=0), seed=4, num_samples=400)], [logits])
    assert set(result.token_ids) == set(range(VOCAB))
    assert len(result.ranks) == len(result.token_ids)
    for token, rank in zip(result.token_ids, result.ranks):
        assert rank == by_rank.index(token) + 1
    [greedy] = _sample([_row(SamplingParams(logprobs=0))], [logits])
    assert greedy.token_ids == [1] and greedy.ranks == [1]


def test_rank_of_a_penalised_greedy_pick_is_its_raw_rank():
    [result] = _sample([_row(SamplingParams(repetition_penalty=10.0, logprobs=1), output=[0])])
    assert result.token_ids == [1]
    assert result.ranks == [2]
    assert result.logprobs == pytest.approx([RAW_LOGPROBS[1]])
    assert result.top_ids == [[0]]


@pytest.mark.parametrize("num_top", [1, 3, VOCAB])
def test_top_logprobs_are_the_k_best_raw_tokens_best_first(num_top):
    logits = [0.1, 3.0, -2.0, 1.0, 0.5, 2.0, -1.0, 0.0]
    raw = torch.log_softmax(torch.tensor(logits), dim=-1).tolist()
    best = sorted(range(VOCAB), key=lambda i: -logits[i])[:num_top]
    [result] = _sample([_row(SamplingParams(temperature=1.0, logprobs=num_top), seed=0)], [logits])
    assert result.top_ids == [best]
    assert result.top_logprobs[0] == pytest.approx([raw[i] for i in best])


@pytest.mark.parametrize("logprobs", [None, 0])
def test_no_top_list_without_top_logprobs_but_the_chosen_logprob_is_reported(logprobs):
    [result] = _sample([_row(SamplingParams(logprobs=logprobs))])
    assert result.top_ids == [] and result.top_logprobs == []
    assert result.logprobs == pytest.approx([RAW_LOGPROBS[0]])
    # Ranks are computed only when logprobs are asked for (they cost a pass over the vocabulary).
    assert result.ranks == ([] if logprobs is None else [1])


def test_logprobs_are_computed_in_float32_from_half_precision_logits():
    logits = _tensor([LOGITS], dtype=torch.bfloat16)
    [result] = Sampler(0)(logits, [_row(SamplingParams(logprobs=2))])
    expected = torch.log_softmax(logits.float(), dim=-1)[0]
    assert result.logprobs == pytest.approx([expected[0].item()])


# ------------------------------------------------------------------------------------------- beam candidates


@pytest.mark.parametrize("num_candidates", [1, 3, 6])
def test_beam_candidates_returns_that_many_best_token_logprob_pairs(num_candidates):
    row = _row(SamplingParams(use_beam_search=True, best_of=3))
    row.beam_candidates = num_candidates
    [result] = _sample([row])
    assert result.beam_ids == list(range(num_candidates))
    assert result.beam_logprobs == pytest.approx(RAW_LOGPROBS[:num_candidates])
    assert result.token_ids == [] and result.logprobs == [] and result.ranks == []


def test_beam_candidates_exclude_eos_before_min_tokens():
    row = _row(_with_eos(use_beam_search=True, best_of=2, min_tokens=1))
    row.beam_candidates = 3
    [result] = _sample([row], [EOS_FIRST])
    assert EOS not in result.beam_ids
    assert result.beam_ids[0] == 3
    assert math.fsum(math.exp(lp) for lp in result.beam_logprobs) < 1.0


def test_beam_rows_and_sampling_rows_share_a_batch():
    beam = _row(SamplingParams(use_beam_search=True, best_of=2))
    beam.beam_candidates = 2
    rows = [_row(SamplingParams()), beam, _row(SamplingParams(temperature=1.0), seed=0, num_samples=4)]
    greedy, beams, sampled = _sample(rows)
    assert greedy.token_ids == [0]
    assert beams.beam_ids == [0, 1]
    assert len(sampled.token_ids) == 4
