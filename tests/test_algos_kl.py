"""KL estimators, straight-through variants, KL controllers and KL in the reward, against formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_penalty,
)
from verl_core.config.algorithm import KLControlConfig


def reference_kl(log_prob: float, ref_log_prob: float, name: str) -> float:
    """Each estimator written out for one token (Schulman 2020), with verl's clamps for k3."""
    d = log_prob - ref_log_prob
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d * d
    log_ratio = min(max(ref_log_prob - log_prob, -20.0), 20.0)
    return min(max(math.exp(log_ratio) - log_ratio - 1.0, -10.0), 10.0)


BASE_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
log_probs = st.floats(-30.0, 0.0, allow_nan=False)


def test_penalty_names():
    assert set(KL_PENALTIES) == set(BASE_NAMES) | {f"{name}+" for name in BASE_NAMES}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(log_probs, log_probs), min_size=1, max_size=8), st.sampled_from(BASE_NAMES))
def test_estimators_match_their_formula(pairs, name):
    log_prob = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref_log_prob = torch.tensor([r for _, r in pairs], dtype=torch.float64)
    got = kl_penalty(log_prob, ref_log_prob, name)
    for value, (p, r) in zip(got.tolist(), pairs, strict=True):
        assert value == pytest.approx(reference_kl(p, r, name), rel=1e-9, abs=1e-12)


def test_low_var_kl_is_clamped_and_finite_far_from_the_reference():
    got = kl_penalty(torch.tensor([-100.0, 0.0, 0.0]), torch.tensor([0.0, -100.0, -5.0]), "low_var_kl")
    # exp(20) - 21 and exp(-20) + 19 are both clamped to 10; exp(-5) + 4 is not.
    assert got.tolist() == [10.0, 10.0, pytest.approx(math.exp(-5) + 4)]
    assert torch.isfinite(got).all()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(log_probs, log_probs), min_size=1, max_size=8), st.sampled_from(BASE_NAMES))
def test_straight_through_variants_have_the_base_value_and_the_k2_gradient(pairs, name):
    log_prob = torch.tensor([p for p, _ in pairs], dtype=torch.float64, requires_grad=True)
    ref_log_prob = torch.tensor([r for _, r in pairs], dtype=torch.float64)
    value = kl_penalty(log_prob, ref_log_prob, f"{name}+")
    torch.testing.assert_close(value.detach(), kl_penalty(log_prob, ref_log_prob, name).detach())
    (gradient,) = torch.autograd.grad(value.sum(), log_prob)
    expected = [p - r for p, r in pairs]  # d/dp of (p - r)^2 / 2
    torch.testing.assert_close(gradient, torch.tensor(expected, dtype=torch.float64))


def test_unknown_penalty_lists_the_valid_ones_and_suggests_a_close_match():
    with pytest.raises(ValueError) as error:
        kl_penalty(torch.zeros(2), torch.zeros(2), "low_var_k")
    message = str(error.value)
    assert "'low_var_k'" in message and "did you mean 'low_var_kl'" in message
    assert "algorithm.kl_penalty" in message and "k3+" in message


def test_fixed_controller_never_changes():
    controller = build_kl_controller(KLControlConfig(type="fixed", kl_coef=0.05))
    assert isinstance(controller, FixedKLController)
    controller.update(current_kl=3.0, n_steps=1000)
    assert controller.value == 0.05


@pytest.mark.parametrize(
    "current_kl, expected_error",
    [(0.1, 0.0), (0.11, 0.1), (0.5, 0.2), (0.0, -0.2), (0.095, -0.05)],
)
def test_adaptive_controller_follows_ziegler(current_kl, expected_error):
    controller = build_kl_controller(
        KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=1000)
    )
    assert isinstance(controller, AdaptiveKLController)
    controller.update(current_kl=current_kl, n_steps=100)
    # error = clip(KL / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon
    assert controller.value == pytest.approx(0.2 * (1 + expected_error * 100 / 1000))


def test_unknown_controller_type_names_the_key_and_the_choices():
    with pytest.raises(
        ValueError, match=r"algorithm\.kl_ctrl\.type: unknown controller 'pid'; use 'fixed' or"
    ):
        build_kl_controller(KLControlConfig(type="pid"))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["kl", "low_var_kl"])
def test_kl_in_reward_matches_reference_and_drives_the_controller(name):
    scores = [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 2.0]]
    old = [[-1.0, -2.0, -0.5, -9.0], [-1.0, -1.0, -1.0, -1.0], [-0.2, -3.0, -3.0, -1.5]]
    ref = [[-1.5, -1.0, -0.5, 0.0], [-2.0, -2.0, -2.0, -2.0], [-0.1, 9.0, 9.0, -1.0]]
    mask = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]]  # padding, an empty response, an observation span
    beta = 0.3
    controller = AdaptiveKLController(value=beta, target_kl=0.05, horizon=30)

    rewards, metrics = apply_kl_penalty(
        token_level_scores=torch.tensor(scores, dtype=torch.float64),
        old_log_probs=torch.tensor(old, dtype=torch.float64),
        ref_log_prob=torch.tensor(ref, dtype=torch.float64),
        response_mask=torch.tensor(mask),
        kl_ctrl=controller,
        kl_penalty_name=name,
    )

    expected_rewards, sequence_kls = [], []
    for i in range(3):
        token_kls = [reference_kl(old[i][t], ref[i][t], name) if mask[i][t] else 0.0 for t in range(4)]
        expected_rewards.append([scores[i][t] - beta * token_kls[t] for t in range(4)])
        if sum(mask[i]):
            sequence_kls.append(sum(token_kls) / sum(mask[i]))
    current_kl = sum(sequence_kls) / len(sequence_kls)  # the empty response does not count
    torch.testing.assert_close(rewards, torch.tensor(expected_rewards, dtype=torch.float64))
    assert metrics == {
        "actor/reward_kl_penalty": pytest.approx(current_kl),
        "actor/reward_kl_penalty_coeff": beta,
    }
    error = min(max(current_kl / 0.05 - 1, -0.2), 0.2)
    assert controller.value == pytest.approx(beta * (1 + error * 3 / 30))


def test_kl_in_reward_with_no_response_tokens_reports_zero():
    controller = FixedKLController(value=0.1)
    rewards, metrics = apply_kl_penalty(
        token_level_scores=torch.ones(2, 3),
        old_log_probs=torch.zeros(2, 3),
        ref_log_prob=torch.full((2, 3), -1.0),
        response_mask=torch.zeros(2, 3),
        kl_ctrl=controller,
    )
    assert torch.equal(rewards, torch.ones(2, 3)) and metrics["actor/reward_kl_penalty"] == 0.0
