"""SamplingParams: every invalid value is rejected with a message naming the field and its allowed range,
and the derived views (greedy or not, beam width, sequences, stop ids) say what the engine should do."""

from __future__ import annotations

import dataclasses
import math

import pytest

from raylm.sampling_params import SamplingParams

BOOL_FIELDS = [
    "use_beam_search",
    "include_stop_str_in_output",
    "ignore_eos",
    "detokenize",
    "add_special_tokens",
    "skip_special_tokens",
]

# (kwargs, message pattern): each must raise ValueError naming the field and the allowed range.
OUT_OF_RANGE = [
    ({"temperature": -0.1}, r"temperature must be >= 0\.0, got -0\.1"),
    ({"temperature": -1e-9}, r"temperature must be >= 0\.0"),
    ({"top_p": 0.0}, r"top_p must be in \(0\.0, 1\.0\], got 0\.0"),
    ({"top_p": -0.5}, r"top_p must be in \(0\.0, 1\.0\], got -0\.5"),
    ({"top_p": 1.0001}, r"top_p must be in \(0\.0, 1\.0\], got 1\.0001"),
    ({"top_k": -1}, r"top_k must be >= 0, got -1"),
    ({"min_p": -0.01}, r"min_p must be in \[0\.0, 1\.0\], got -0\.01"),
    ({"min_p": 1.5}, r"min_p must be in \[0\.0, 1\.0\], got 1\.5"),
    ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ({"max_tokens": -3}, r"max_tokens must be >= 1, got -3"),
    ({"min_tokens": -1}, r"min_tokens must be >= 0, got -1"),
    ({"min_tokens": 6, "max_tokens": 5}, r"min_tokens must be <= max_tokens \(5\), got 6"),
    ({"n": 0}, r"n must be >= 1, got 0"),
    ({"best_of": 0}, r"best_of must be >= 1, got 0"),
    ({"n": 3, "best_of": 2}, r"best_of must be >= n \(3\), got 2"),
    ({"logprobs": -1}, r"logprobs must be in \[0, 20\], got -1"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs must be in \[0, 20\], got -1"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\], got 21"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0\.0, got 0\.0"),
    ({"repetition_penalty": -1.0}, r"repetition_penalty must be > 0\.0, got -1\.0"),
    ({"presence_penalty": 2.01}, r"presence_penalty must be in \[-2\.0, 2\.0\], got 2\.01"),
    ({"presence_penalty": -2.01}, r"presence_penalty must be in \[-2\.0, 2\.0\], got -2\.01"),
    ({"frequency_penalty": 3}, r"frequency_penalty must be in \[-2\.0, 2\.0\], got 3"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2\.0, 2\.0\], got -2\.5"),
    ({"seed": 2**64}, r"seed must be in \[-9223372036854775808, 18446744073709551615\], got 18446744073709551616"),
    ({"seed": -(2**63) - 1}, r"seed must be in \[-9223372036854775808, 18446744073709551615\]"),
    ({"use_beam_search": True, "temperature": 1e-5}, r"use_beam_search .*temperature"),
    ({"end_id": -1}, r"end_id must be >= 0, got -1"),
    ({"stop_token_ids": [3, -1]}, r"stop_token_ids must be >= 0, got -1"),
    ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be >= 1, got 0"),
    ({"early_stopping": "always"}, r"early_stopping must be True, False or 'never', got 'always'"),
    ({"stop": ""}, r"stop strings must not be empty"),
    ({"stop": ["ok", ""]}, r"stop strings must not be empty"),
    ({"use_beam_search": True, "temperature": 0.7}, r"use_beam_search .*temperature"),
]

NON_FINITE_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"]

# (kwargs, message pattern): each must raise TypeError naming the field and the expected type.
WRONG_TYPE = [
    ({"temperature": "0.7"}, r"temperature must be a number, got str"),
    ({"temperature": True}, r"temperature must be a number, got bool"),
    ({"top_p": [0.9]}, r"top_p must be a number, got list"),
    ({"min_p": False}, r"min_p must be a number, got bool"),
    ({"repetition_penalty": None}, r"repetition_penalty must be a number, got NoneType"),
    ({"length_penalty": "1"}, r"length_penalty must be a number, got str"),
    ({"top_k": 2.0}, r"top_k must be an integer, got float"),
    ({"top_k": True}, r"top_k must be an integer, got bool"),
    ({"max_tokens": 1.5}, r"max_tokens must be an integer, got float"),
    ({"max_tokens": "16"}, r"max_tokens must be an integer, got str"),
    ({"min_tokens": None}, r"min_tokens must be an integer, got NoneType"),
    ({"n": 2.0}, r"n must be an integer, got float"),
    ({"best_of": True}, r"best_of must be an integer, got bool"),
    ({"seed": 1.0}, r"seed must be an integer, got float"),
    ({"end_id": "2"}, r"end_id must be an integer, got str"),
    ({"logprobs": 1.0}, r"logprobs must be an integer, got float"),
    ({"prompt_logprobs": 2.5}, r"prompt_logprobs must be an integer, got float"),
    ({"truncate_prompt_tokens": 1.0}, r"truncate_prompt_tokens must be an integer, got float"),
    ({"stop_token_ids": [1, 2.0]}, r"stop_token_ids must be an integer, got float"),
    ({"stop_token_ids": [True]}, r"stop_token_ids must be an integer, got bool"),
    ({"stop_token_ids": ["7"]}, r"stop_token_ids must be an integer, got str"),
    ({"stop": ["ok", 3]}, r"stop must be a string or a list of strings"),
    ({"stop": [None]}, r"stop must be a string or a list of strings"),
    ({"early_stopping": 1}, r"early_stopping must be a bool, got int"),
]


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("kwargs", "message"), OUT_OF_RANGE, ids=[str(k) for k, _ in OUT_OF_RANGE])
def test_out_of_range_value_raises_value_error_naming_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", NON_FINITE_FIELDS)
def test_non_finite_float_raises_value_error_naming_field_and_range(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number( in | >= | > )?.*, got"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(("kwargs", "message"), WRONG_TYPE, ids=[str(k) for k, _ in WRONG_TYPE])
def test_wrong_type_raises_type_error_naming_field(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("value", [1, 0, None, 1.0, [True]], ids=["1", "0", "None", "1.0", "list"])
@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_bool_field_given_a_non_bool_raises_type_error(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a bool, got {type(value).__name__}"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_bool_field_given_a_string_raises_type_error(name):
    with pytest.raises(TypeError, match=rf"{name} must be a bool, got str"):
        SamplingParams(**{name: "no"})


def test_stop_token_ids_given_a_bare_int_raises_type_error_naming_field():
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)


def test_stop_given_a_bare_int_raises_type_error_naming_field():
    with pytest.raises(TypeError, match="stop"):
        SamplingParams(stop=5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0},
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"min_tokens": 5, "max_tokens": 5},
        {"n": 3, "best_of": 3},
        {"logprobs": 0},
        {"logprobs": 20},
        {"prompt_logprobs": 20},
        {"repetition_penalty": 1e-3},
        {"presence_penalty": -2.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": -2},
        {"frequency_penalty": 2},
        {"seed": 0},
        {"seed": -1},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"use_beam_search": True, "temperature": 1e-6, "best_of": 2},
        {"end_id": 0},
        {"stop_token_ids": [0]},
        {"early_stopping": "never"},
        {"early_stopping": True},
        {"use_beam_search": True, "temperature": 0.0, "best_of": 2},
        {"length_penalty": -1.5},
        {"truncate_prompt_tokens": 1},
    ],
    ids=str,
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_replace_revalidates_the_new_values():
    params = SamplingParams(temperature=0.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0\.0, 1\.0\]"):
        dataclasses.replace(params, top_p=1.5)


# ------------------------------------------------------------------------------------------- normalisation


def test_stop_given_as_a_string_becomes_a_one_item_list():
    assert SamplingParams(stop="END").stop == ["END"]


def test_stop_given_as_a_tuple_becomes_a_list():
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_stop_and_stop_token_ids_default_to_empty_lists():
    params = SamplingParams()
    assert params.stop == []
    assert params.stop_token_ids == []


def test_prompt_logprobs_true_becomes_zero_and_false_becomes_none():
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs is None
    assert SamplingParams(prompt_logprobs=3).prompt_logprobs == 3


# ------------------------------------------------------------------------------------------- derived views


def test_defaults_are_greedy_like_the_llm_api():
    params = SamplingParams()
    assert params.is_greedy
    assert params.effective_temperature == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0.0, "top_p": 0.9, "top_k": 40, "min_p": 0.1},
        {"top_k": 1},
        {"top_k": 1, "temperature": 0.8},
        {"top_k": 1, "top_p": 0.5},
        {"temperature": 1e-45},
        {"temperature": 9.9e-6, "top_p": 0.9},
    ],
    ids=str,
)
def test_temperature_below_1e_5_or_top_k_one_is_greedy(kwargs):
    assert SamplingParams(**kwargs).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.7},
        {"temperature": 1.0},
        {"temperature": 1e-5},
        {"top_p": 0.9},
        {"top_p": 1.0},
        {"top_k": 50},
        {"top_k": 0},
        {"min_p": 0.1},
        {"temperature": 0.7, "top_k": 50, "top_p": 0.95},
    ],
    ids=str,
)
def test_positive_temperature_or_a_filter_means_sampling(kwargs):
    assert not SamplingParams(**kwargs).is_greedy


def test_effective_temperature_is_the_given_temperature():
    assert SamplingParams(temperature=0.3).effective_temperature == 0.3
    assert SamplingParams(top_p=0.9).effective_temperature == 1.0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({}, 1), ({"n": 3}, 3), ({"n": 2, "best_of": 5}, 5), ({"best_of": 4, "use_beam_search": True}, 4)],
    ids=str,
)
def test_beam_width_and_num_sequences_are_best_of_else_n(kwargs, expected):
    params = SamplingParams(**kwargs)
    assert params.beam_width == expected
    assert params.num_sequences == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"presence_penalty": -0.5}, True),
        ({"frequency_penalty": 0.5}, True),
    ],
    ids=str,
)
def test_has_penalties_is_true_only_when_a_penalty_is_not_neutral(kwargs, expected):
    assert SamplingParams(**kwargs).has_penalties is expected


def _with_eos(**kwargs) -> SamplingParams:
    return dataclasses.replace(SamplingParams(**kwargs), _eos_token_ids=(2, 9))


def test_all_stop_token_ids_are_tokenizer_eos_plus_stop_token_ids():
    assert _with_eos(stop_token_ids=[5, 7]).all_stop_token_ids == frozenset({2, 9, 5, 7})


def test_all_stop_token_ids_drop_eos_when_ignore_eos():
    assert _with_eos(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids == frozenset({5})
    assert _with_eos(ignore_eos=True).all_stop_token_ids == frozenset()


def test_end_id_replaces_tokenizer_eos_in_all_stop_token_ids():
    assert _with_eos(end_id=11, stop_token_ids=[5]).all_stop_token_ids == frozenset({11, 5})
    assert _with_eos(end_id=11, ignore_eos=True).all_stop_token_ids == frozenset()


def test_all_stop_token_ids_without_eos_or_stop_ids_is_empty():
    assert SamplingParams().all_stop_token_ids == frozenset()
