"""Scoring and prefill options beyond the paper: each against the naive reference or against decoding.

Sinks, the ``mean`` importance, value weighting and a fractional recent window
are checked against the naive reference (kept sets and outputs); the paper preset
for reproducing the published settings. Through the transformers cache
(tests/hf/test_options_cache.py), every option is checked for exactness of the
compressed scorer, and the prompt-aware prefill for its invariants, batch = alone,
and exact continuation scoring.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reference import cases, check_case

from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import PRESETS, CacheSettings, ScissorhandsConfig


@st.composite
def option_cases(draw):
    case = draw(cases())
    room = case["budget"] - case["recent"] - case["drop"]
    case["sinks"] = draw(st.integers(0, max(room, 0)))
    case["importance"] = draw(st.sampled_from(["sum", "count", "mean"]))
    # small caps, so that these short sequences have tokens scored by more queries than the cap
    case["mean_cap"] = draw(st.one_of(st.none(), st.integers(1, 12)))
    case["value_weighted"] = draw(st.booleans())
    return case


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option_cases())
def test_options_match_reference(case):
    check_case(case)


def test_paper_preset_is_the_published_setting_and_user_values_win():
    paper = ScissorhandsConfig(budget=100, preset="paper")
    for name, value in PRESETS["paper"].items():
        assert getattr(paper, name) == value
    assert (paper.window, paper.recent, paper.window_buckets) == (400, 10, None)
    assert ScissorhandsConfig(budget=100, preset="paper", recent=32).recent == 32
    # a method's own settings survive the preset, even where they equal a library default
    h2o = get_method("h2o").resolve(CacheSettings(preset="paper"))
    assert (h2o.window, h2o.recent, h2o.drop, h2o.importance) == (None, 10, 0.4, "sum")
    with pytest.raises(ValueError, match="^preset:"):
        ScissorhandsConfig(budget=100, preset="nope")


@pytest.mark.parametrize("kwargs,param", [
    (dict(sinks=-1), "sinks"),
    (dict(recent=1.5), "recent"),
    (dict(importance="max"), "importance"),
    (dict(value_weighted="yes"), "value_weighted"),
    (dict(merge=1), "merge"),
    (dict(prefill="snap"), "prefill"),
    (dict(observe=0), "observe"),
    (dict(budget=8, recent=4, sinks=4), "budget"),
])
def test_new_options_are_validated_in_one_line(kwargs, param):
    with pytest.raises(ValueError, match=f"^{param}:"):
        ScissorhandsConfig(**{"budget": 64, **kwargs})
