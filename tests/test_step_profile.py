"""The idle-gap analysis of benchmarks/step_profile.py on made-up timelines."""

from __future__ import annotations

import pytest

from benchmarks.step_profile import idle_gaps, short_kernel_name


def test_gaps_are_summed_per_neighbouring_pair_and_per_step():
    timeline = [("norm", 0, 2), ("gemv<64>(float*)", 3, 10), ("norm", 12, 14), ("gemv<64>(float*)", 15, 22),
                ("argmax", 30, 31)]
    result = idle_gaps(timeline, steps=2, top=2)
    assert result["idle_us_per_step"] == pytest.approx((1 + 2 + 1 + 8) / 2)
    assert result["gaps"][0] == {"before": "gemv", "after": "argmax", "us_per_step": 4.0, "per_step": 0.5}
    assert result["gaps"][1] == {"before": "norm", "after": "gemv", "us_per_step": 1.0, "per_step": 1.0}


def test_overlapping_activities_idle_nothing_and_the_last_to_end_comes_before_a_gap():
    # b starts inside a and ends later; c starts inside a too but ends first: the gap before d follows b.
    timeline = [("a", 0, 10), ("c", 2, 5), ("b", 8, 20), ("d", 25, 26)]
    result = idle_gaps(timeline, steps=1, top=5)
    assert result["idle_us_per_step"] == 5
    assert result["gaps"] == [{"before": "b", "after": "d", "us_per_step": 5.0, "per_step": 1.0}]
    assert idle_gaps([], steps=1, top=3) == {"idle_us_per_step": 0.0, "gaps": []}


def test_kernel_names_lose_their_template_and_argument_lists():
    assert short_kernel_name("void at::native::reduce_kernel<512, 1>(at::native::ReduceOp)") == \
        "void at::native::reduce_kernel"
    assert short_kernel_name("_gemv_kernel") == "_gemv_kernel"
