"""Drawing the next token (``verl_core.rollout.sampling``): the frequencies of many draws against the
exact probabilities (a chi-square test), tokens outside top-k / top-p never drawn, seeds that
reproduce, and the sampler variants the check must catch.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from verl_core.rollout import sampling as sampling_module
from verl_core.rollout.base import SamplingParams
from verl_core.rollout.sampling import draw, sample_next

DRAWS = 20_000
#: A correct sampler fails one check in a million; hypothesis runs a few dozen.
SIGNIFICANCE = 1e-6


def params(**changes) -> SamplingParams:
    return SamplingParams(**({"max_new_tokens": 1, "eos_token_ids": (), "pad_token_id": 0} | changes))


def top_k_weights(logits: list[float], sampling: SamplingParams) -> tuple[torch.Tensor, list[int]]:
    """softmax(logits / T) over the top k tokens, most likely first, and those tokens."""
    scaled = torch.tensor(logits, dtype=torch.float64) / sampling.temperature
    order = sorted(range(len(logits)), key=lambda i: -scaled[i].item())
    allowed = order[: sampling.top_k] if 0 < sampling.top_k < len(logits) else order
    return scaled[allowed].exp() / scaled[allowed].exp().sum(), allowed


def exact_probabilities(logits: list[float], sampling: SamplingParams) -> torch.Tensor:
    """Written out: softmax(logits / T) restricted to the top k, then to the smallest set of the most
    likely tokens whose mass reaches top_p, renormalised."""
    scaled = torch.tensor(logits, dtype=torch.float64) / sampling.temperature
    weights, allowed = top_k_weights(logits, sampling)
    kept, mass = [], 0.0
    for token, weight in zip(allowed, weights.tolist(), strict=True):
        if sampling.top_p < 1.0 and mass >= sampling.top_p:
            break
        kept.append(token)
        mass += weight
    probabilities = torch.zeros(len(logits), dtype=torch.float64)
    probabilities[kept] = scaled[kept].exp() / scaled[kept].exp().sum()
    return probabilities


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probabilities``. Its approximation needs every category
    expected at least 5 times: the possible tokens are pooled, least likely first, until each pool is
    (the impossible ones are checked apart: never drawn)."""
    expected = probabilities * counts.sum()
    order = [int(i) for i in torch.argsort(expected) if expected[i] > 0]
    pools_observed, pools_expected, observed, mass = [], [], 0.0, 0.0
    for index in order:
        observed, mass = observed + float(counts[index]), mass + float(expected[index])
        if mass >= 5:
            pools_observed.append(observed)
            pools_expected.append(mass)
            observed, mass = 0.0, 0.0
    if mass > 0 and pools_expected:  # a remainder below 5 joins the last pool
        pools_observed[-1] += observed
        pools_expected[-1] += mass
    if len(pools_expected) < 2:
        return 1.0
    observed_t, expected_t = torch.tensor(pools_observed), torch.tensor(pools_expected, dtype=torch.float64)
    statistic = ((observed_t - expected_t) ** 2 / expected_t).sum()
    degrees = len(pools_expected) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2.0, dtype=torch.float64), statistic / 2))


def assert_draws_follow_the_distribution(
    logits: list[float], sampling: SamplingParams, seed: int = 0
) -> None:
    rows = torch.tensor([logits], dtype=torch.float32).expand(DRAWS, -1)
    tokens, _ = sample_next(rows, sampling, torch.Generator().manual_seed(seed))
    counts = torch.bincount(tokens, minlength=len(logits))
    probabilities = exact_probabilities(logits, sampling)
    impossible = counts[probabilities == 0]
    assert int(impossible.sum()) == 0, f"drew tokens of probability 0: counts {counts.tolist()}"
    p_value = chi_square_p_value(counts, probabilities)
    assert p_value > SIGNIFICANCE, (
        f"frequencies {(counts / DRAWS).tolist()} against probabilities {probabilities.tolist()}: p={p_value:.2e}"
    )


def on_a_nucleus_edge(logits: list[float], sampling: SamplingParams) -> bool:
    """Whether the mass before some token is within float32 rounding of ``top_p``: there float32 and
    the float64 reference may disagree on which tokens the nucleus keeps, both rightly."""
    before = top_k_weights(logits, sampling)[0].cumsum(0)
    return sampling.top_p < 1.0 and bool(((before - sampling.top_p).abs() < 1e-4).any())


@settings(max_examples=30, deadline=None)
@given(
    # Distinct tenths: no two logits round to the same float32 (a tie at the top-k cut keeps both).
    logits=st.lists(st.integers(-50, 50), min_size=2, max_size=12, unique=True).map(
        lambda tenths: [tenth / 10 for tenth in tenths]
    ),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.integers(0, 12),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2]),
    seed=st.integers(0, 2**31),
)
def test_the_draws_follow_the_exact_probabilities(logits, temperature, top_k, top_p, seed) -> None:
    sampling = params(temperature=temperature, top_k=top_k, top_p=top_p)
    assume(not on_a_nucleus_edge(logits, sampling))
    assert_draws_follow_the_distribution(logits, sampling, seed)


def test_a_large_vocabulary_with_one_likely_token_and_a_long_tail() -> None:
    # Llama-sized: the tail's mass is spread over 49k tokens, each far below float32's precision of
    # the running sum; together they hold about a third of the mass.
    vocabulary = 49_152
    logits = torch.full((vocabulary,), -10.0)
    logits[7] = 0.0
    logits[vocabulary - 1] = 1.0
    probabilities = logits.double().softmax(dim=-1)
    draws = 1000  # rows of 49k tokens: the memory of 20k would be gigabytes
    tokens, _ = sample_next(logits.expand(draws, -1), params(), torch.Generator().manual_seed(3))
    for token in (7, vocabulary - 1):
        share = float((tokens == token).double().mean())
        sigma = (probabilities[token] * (1 - probabilities[token]) / draws).sqrt()
        assert abs(share - probabilities[token]) < 6 * sigma
    tail = probabilities.clone()
    tail[[7, vocabulary - 1]] = 0
    share = float(((tokens != 7) & (tokens != vocabulary - 1)).double().mean())
    assert abs(share - tail.sum()) < 6 * (tail.sum() * (1 - tail.sum()) / draws).sqrt()


def test_certain_tokens_and_impossible_ones_at_the_ends_of_the_vocabulary() -> None:
    for certain in (0, 5, 9):
        log_probs = torch.full((4, 10), float("-inf"), dtype=torch.float64)
        log_probs[:, certain] = 0.0
        assert draw(log_probs, torch.Generator().manual_seed(certain)).tolist() == [certain] * 4


def test_a_uniform_number_that_rounds_up_to_the_total_takes_the_last_possible_token(monkeypatch) -> None:
    log_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]], dtype=torch.float64).log()
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.ones(shape, dtype=torch.float64))
    assert draw(log_probs, None).tolist() == [1]


def test_the_same_seed_draws_the_same_tokens_and_another_seed_others() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))

    def tokens(seed: int) -> torch.Tensor:
        return sample_next(logits, params(), torch.Generator().manual_seed(seed))[0]

    assert torch.equal(tokens(1), tokens(1))
    assert not torch.equal(tokens(1), tokens(2))
    generator = torch.Generator().manual_seed(1)
    first, second = (sample_next(logits, params(), generator)[0] for _ in range(2))
    assert not torch.equal(first, second)  # the generator moves on between steps


# -- samplers the check must catch -----------------------------------------------------------------


def off_by_one(log_probs, generator):
    """Locates the uniform number one token too far (``right=True`` plus one)."""
    return (draw(log_probs, generator) + 1).clamp(max=log_probs.shape[-1] - 1)


def flattened(log_probs, generator):
    """Draws from ``sqrt(p)`` renormalised, as a sampler that applies the temperature twice would."""
    return draw((log_probs / 2).log_softmax(dim=-1), generator)


def first_token_only(log_probs, generator):
    """The same uniform number for every row: each row alone is right, the rows are not independent."""
    cumulative = log_probs.double().exp().cumsum(dim=-1)
    uniform = torch.rand((), generator=generator, dtype=torch.float64).expand(len(log_probs), 1)
    return torch.searchsorted(cumulative, uniform.contiguous() * cumulative[:, -1:], right=True)[:, 0]


def unfiltered(scaled, top_k, top_p):
    """Ignores top-k / top-p: draws from the whole softmax."""
    return scaled


@pytest.mark.parametrize(
    ("name", "broken"),
    [("draw", off_by_one), ("draw", flattened), ("draw", first_token_only), ("filter_logits", unfiltered)],
)
def test_the_check_catches_a_sampler_that_draws_another_distribution(monkeypatch, name, broken) -> None:
    monkeypatch.setattr(sampling_module, name, broken)
    with pytest.raises(AssertionError):
        assert_draws_follow_the_distribution([1.0, 0.2, -0.5, 2.0, 0.0], params(top_k=4, temperature=0.8))


# -- SamplingParams: every field checked on construction --------------------------------------------


def is_whole(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: What each field accepts, written out: ``temperature`` 0 is greedy, ``top_k`` 0 and ``top_p`` 1 are off.
VALID = {
    "max_new_tokens": lambda v: is_whole(v, 1),
    "pad_token_id": lambda v: is_whole(v, 0),
    "eos_token_ids": lambda v: isinstance(v, (tuple, list)) and all(is_whole(i, 0) for i in v),
    "temperature": lambda v: is_finite(v) and v >= 0,
    "top_k": lambda v: is_whole(v, 0),
    "top_p": lambda v: is_finite(v) and 0 < v <= 1,
}
ANY_VALUE = st.one_of(
    st.integers(-3, 3),
    st.floats(-2, 2),
    st.sampled_from([0.0, -0.0, 1.0, 5e-324, math.inf, -math.inf, math.nan, 1 + 1e-9]),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
    st.lists(st.integers(-2, 3), max_size=3).flatmap(lambda ids: st.sampled_from([ids, tuple(ids)])),
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(sorted(VALID)), value=ANY_VALUE)
def test_sampling_params_accept_exactly_the_valid_values(field, value) -> None:
    """On main ``temperature=-1`` sampled the inverted distribution and ``top_p=0`` raised an index error
    at the first draw; every field is now refused on construction, naming it."""
    if VALID[field](value):
        assert getattr(params(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}=.*: must be "):
            params(**{field: value})


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30), min_size=1, max_size=8),
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 20)),
    top_k=st.integers(0, 10),
    top_p=st.one_of(st.just(5e-324), st.floats(1e-6, 1)),
    seed=st.integers(0, 2**31),
)
def test_every_accepted_setting_draws_a_token_the_filters_allow(
    logits, temperature, top_k, top_p, seed
) -> None:
    """The smallest top_p keeps the most likely token (on main a top_p below float32's precision kept
    none, and the draw raised an index error); log-probs are those of softmax(logits / T)."""
    sampling = params(temperature=temperature, top_k=top_k, top_p=top_p)
    row = torch.tensor([logits])
    tokens, log_probs = sample_next(row, sampling, torch.Generator().manual_seed(seed))
    token = int(tokens[0])
    assert 0 <= token < len(logits)
    if sampling.greedy or top_p == 5e-324:  # below float32's precision: only the most likely token
        assert row[0, token] == row.max()
    reference = torch.tensor(logits, dtype=torch.float64) / (temperature or 1.0)
    assert float(log_probs[0]) == pytest.approx(float(reference.log_softmax(0)[token]), abs=1e-4)
