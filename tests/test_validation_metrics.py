"""Validation metrics: the unbiased pass@k estimator against its formula written out with
``math.comb`` (exact fractions) and against the brute-force expectation over every k-subset of the
samples, its exact edges and monotonicity; ``summarize`` against hand-computed metrics per data
source and overall, the correctness threshold, and every way its input is refused."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_core.trainer.metrics import VAL_SCORE_KEY
from verl_core.trainer.validation import CORRECT_THRESHOLD, pass_at_k, summarize


@st.composite
def n_c_k(draw, max_n: int = 80) -> tuple[int, int, int]:
    n = draw(st.integers(1, max_n))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


def by_formula(n: int, c: int, k: int) -> Fraction:
    """Chen et al. 2021: 1 - C(n - c, k) / C(n, k) (``math.comb`` is 0 when k > n - c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def by_brute_force(n: int, c: int, k: int) -> Fraction:
    """The chance that k of the n samples, drawn without replacement, hold a correct one (the first
    c samples are the correct ones): the mean over every k-subset."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(sample < c for sample in subset) for subset in subsets), len(subsets))


@given(n_c_k())
def test_pass_at_k_is_the_formula(case):
    n, c, k = case
    assert pass_at_k(n, c, k) == pytest.approx(float(by_formula(n, c, k)), rel=1e-12, abs=1e-12)


@given(n_c_k(max_n=9))
def test_pass_at_k_is_the_expectation_over_all_k_subsets(case):
    n, c, k = case
    assert pass_at_k(n, c, k) == pytest.approx(float(by_brute_force(n, c, k)), rel=1e-12, abs=1e-12)


@given(n_c_k())
def test_pass_at_k_is_exact_at_its_edges(case):
    n, c, k = case
    if c == 0:
        assert pass_at_k(n, c, k) == 0.0
    if n - c < k:
        assert pass_at_k(n, c, k) == 1.0
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-12, abs=1e-15)
    assert 0.0 <= pass_at_k(n, c, k) <= 1.0


@given(n_c_k())
def test_pass_at_k_grows_with_k_and_with_the_correct_samples(case):
    n, c, k = case
    if k < n:
        assert pass_at_k(n, c, k + 1) >= pass_at_k(n, c, k) - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= pass_at_k(n, c, k) - 1e-12


def test_pass_at_k_stays_accurate_where_the_binomials_are_huge():
    n, c, k = 10_000, 3, 500
    assert pass_at_k(n, c, k) == pytest.approx(float(by_formula(n, c, k)), rel=1e-10)


@pytest.mark.parametrize(
    "n, c, k, message",
    [
        (4, 1, 5, "1 <= k <= n"),
        (4, 1, 0, "1 <= k <= n"),
        (4, 5, 2, "between 0 and n=4"),
        (4, -1, 2, "got c=-1"),
    ],
)
def test_pass_at_k_refuses_impossible_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(n, c, k)


# -- summarize ------------------------------------------------------------------------------------


def test_summarize_per_data_source_and_overall():
    scores = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 1.0]]
    metrics = summarize(scores, ["math", "gsm8k", "math"], k=2)
    # pass@2 with n=4: c=2 -> 1 - C(2,2)/C(4,2) = 5/6; c=0 -> 0; c=3 -> 1 (only one wrong sample).
    assert list(metrics) == [
        "val/gsm8k/mean@2",
        "val/gsm8k/pass@2",
        "val/math/mean@2",
        "val/math/pass@2",
        VAL_SCORE_KEY,
        "val/pass@2",
    ]
    assert metrics["val/gsm8k/mean@2"] == 0.0
    assert metrics["val/gsm8k/pass@2"] == 0.0
    assert metrics["val/math/mean@2"] == pytest.approx((0.5 + 0.875) / 2)
    assert metrics["val/math/pass@2"] == pytest.approx((5 / 6 + 1.0) / 2)
    assert metrics[VAL_SCORE_KEY] == pytest.approx((0.5 + 0.0 + 0.875) / 3)  # each prompt counts once
    assert metrics["val/pass@2"] == pytest.approx((5 / 6 + 0.0 + 1.0) / 3)


def test_greedy_validation_is_k_1_and_pass_at_1_the_fraction_correct():
    metrics = summarize([[1.0], [0.0], [1.0], [0.25]], ["a"] * 4, k=1)
    assert metrics == {
        "val/a/mean@1": pytest.approx(0.5625),
        "val/a/pass@1": 0.5,
        VAL_SCORE_KEY: pytest.approx(0.5625),
        "val/pass@1": 0.5,
    }


def test_correct_threshold_decides_which_samples_pass():
    assert CORRECT_THRESHOLD == 1.0
    scores = [[0.9, 0.2], [0.5, 0.4]]
    assert summarize(scores, ["x", "x"], k=1)["val/pass@1"] == 0.0
    assert summarize(scores, ["x", "x"], k=1, correct_threshold=0.5)["val/pass@1"] == pytest.approx(0.5)
    assert summarize(scores, ["x", "x"], k=2, correct_threshold=0.5)["val/pass@2"] == 1.0


@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=3, max_size=6), st.sampled_from("abc")),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 3),
)
def test_overall_metrics_are_the_prompt_weighted_mean_of_the_sources(prompts, k):
    scores, sources = [list(s) for s, _ in prompts], [source for _, source in prompts]
    metrics = summarize(scores, sources, k)
    counts = {source: sources.count(source) for source in set(sources)}
    for per_source, overall in ((f"mean@{k}", VAL_SCORE_KEY), (f"pass@{k}", f"val/pass@{k}")):
        weighted = sum(metrics[f"val/{source}/{per_source}"] * n for source, n in counts.items())
        assert metrics[overall] == pytest.approx(weighted / len(sources), abs=1e-12)
    assert all(0.0 <= metrics[f"val/{source}/pass@{k}"] <= 1.0 for source in counts)


@pytest.mark.parametrize(
    "scores, sources, k, message",
    [
        ([[1.0]], ["a", "b"], 1, "1 prompts' scores but 2 data sources"),
        ([], [], 1, "no validation prompts"),
        ([[1.0, 0.0], [1.0]], ["a", "b"], 2, r"validation prompt 1 \(b\) has 1 sample\(s\); pass@2"),
        ([[1.0, math.nan]], ["a"], 1, r"validation prompt 0 \(a\) has a score that is not finite"),
    ],
)
def test_summarize_refuses_what_it_cannot_summarize(scores, sources, k, message):
    with pytest.raises(ValueError, match=message):
        summarize(scores, sources, k)
