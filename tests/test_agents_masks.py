"""Multi-turn responses hold environment tokens between the model's: no environment token may get a
reward, an advantage, a return, a log-prob, KL or entropy contribution, or count in a length.

The references are written out here: returns and GAE computed on the model's tokens alone (the
environment spans squeezed out, as the estimators define), then put back in place. Broken variants
are kept and shown to fail: returns reset at each environment span, a mask that leaves environment
tokens in, the outcome reward placed by counting tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algos.actor_loss import compute_actor_loss
from verl_core.algos.advantage import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    masked_whiten,
)
from verl_core.algos.registry import get_advantage_estimator
from verl_core.config.algorithm import AlgorithmConfig, PolicyLossConfig
from verl_core.data.batch import GlobalCounts
from verl_core.trainer.rl import outcome_rewards
from verl_core.trainer.timing import Timer

#: Each row: alternating model / environment span lengths, then padding.
spans = st.lists(st.integers(1, 4), min_size=1, max_size=5)
rows = st.lists(spans, min_size=2, max_size=4)


def masks_of(rows_spans: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(response_mask, real)``: model tokens, and every real token (model and environment)."""
    width = max(sum(row) for row in rows_spans) + 1
    model = torch.zeros(len(rows_spans), width, dtype=torch.int64)
    real = torch.zeros_like(model)
    for r, row in enumerate(rows_spans):
        position = 0
        for number, length in enumerate(row):
            model[r, position : position + length] = int(number % 2 == 0)
            position += length
        real[r, :position] = 1
    return model, real


def squeezed_reference(values: torch.Tensor, mask: torch.Tensor, per_row) -> torch.Tensor:
    """``per_row`` applied to each row's model tokens alone, put back in place (0 elsewhere)."""
    out = torch.zeros(values.shape, dtype=torch.float64)
    for r in range(values.shape[0]):
        where = mask[r].bool()
        out[r, where] = per_row(values[r, where].double())
    return out


def discounted(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    returns, running = torch.zeros_like(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


def returns_reset_at_environment_spans(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Broken on purpose: each model span treated as an episode of its own."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for r in range(rewards.shape[0]):
        start = None
        for t in range(rewards.shape[1] + 1):
            inside = t < rewards.shape[1] and bool(mask[r, t])
            if inside and start is None:
                start = t
            if not inside and start is not None:
                out[r, start:t] = discounted(rewards[r, start:t].double(), gamma)
                start = None
    return out


def scored(mask: torch.Tensor, seed: int) -> torch.Tensor:
    scores = torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(seed))
    return outcome_rewards(scores, mask)


@settings(max_examples=30, deadline=None)
@given(rows_spans=rows, gamma=st.sampled_from([1.0, 0.9]), seed=st.integers(0, 99))
def test_reinforce_plus_plus_carries_returns_across_environment_spans(rows_spans, gamma, seed) -> None:
    mask, _ = masks_of(rows_spans)
    rewards = scored(mask, seed)
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, config=AlgorithmConfig(gamma=gamma)
    )
    reference = squeezed_reference(rewards, mask, lambda r: discounted(r, gamma))
    torch.testing.assert_close(returns.double(), reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(advantages.double(), masked_whiten(reference, mask), atol=1e-4, rtol=1e-4)


def test_returns_reset_at_environment_spans_are_caught() -> None:
    mask, _ = masks_of([[2, 3, 2], [1, 1, 3]])
    rewards = scored(mask, 0)
    _, returns = compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, config=AlgorithmConfig(gamma=0.9)
    )
    broken = returns_reset_at_environment_spans(rewards, mask, 0.9)
    assert not torch.allclose(returns.double(), broken)
    assert broken[0, :2].abs().sum() == 0 and returns[0, :2].abs().sum() > 0  # the first turn learns too


@settings(max_examples=30, deadline=None)
@given(
    rows_spans=rows,
    gamma=st.sampled_from([1.0, 0.9]),
    lam=st.sampled_from([1.0, 0.95]),
    seed=st.integers(0, 99),
)
def test_gae_runs_over_the_model_tokens_as_one_sequence(rows_spans, gamma, lam, seed) -> None:
    mask, _ = masks_of(rows_spans)
    rewards = scored(mask, seed)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 1))

    def gae_row(rewards_and_values: torch.Tensor) -> torch.Tensor:
        r, v = rewards_and_values.unbind(-1)
        advantages, following = torch.zeros_like(r), 0.0
        for t in reversed(range(len(r))):
            next_value = float(v[t + 1]) if t + 1 < len(r) else 0.0
            following = float(r[t]) + gamma * next_value - float(v[t]) + gamma * lam * following
            advantages[t] = following
        return advantages

    stacked = torch.stack([rewards, values], -1)
    reference = torch.zeros(mask.shape, dtype=torch.float64)
    for row in range(mask.shape[0]):
        where = mask[row].bool()
        reference[row, where] = gae_row(stacked[row, where].double())
    advantages, returns = compute_gae_advantage_return(
        token_level_rewards=rewards,
        response_mask=mask,
        values=values,
        config=AlgorithmConfig(gamma=gamma, lam=lam),
    )
    torch.testing.assert_close(returns.double(), (reference + values) * mask, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(advantages.double(), masked_whiten(reference, mask), atol=1e-4, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(rows_spans=st.lists(spans, min_size=4, max_size=4), seed=st.integers(0, 99))
@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gpg"]
)
def test_no_estimator_gives_an_environment_token_an_advantage(name, rows_spans, seed) -> None:
    mask, real = masks_of(rows_spans)
    rewards = scored(mask, seed)
    advantages, returns = get_advantage_estimator(name)(
        token_level_rewards=rewards,
        response_mask=mask,
        index=torch.tensor([0, 0, 1, 1]),
        config=AlgorithmConfig(),
    )
    environment = real.bool() & ~mask.bool()
    assert not advantages[environment].any() and not returns[environment].any()


def test_the_outcome_reward_sits_on_the_last_model_token_not_the_count() -> None:
    mask, real = masks_of([[2, 3, 1]])  # model 2, environment 3, model 1
    rewards = outcome_rewards(torch.tensor([1.0]), mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 1.0, 0]
    # Counting tokens (what a single-turn response allows) would put it on an environment token.
    assert not mask[0, int(mask.sum()) - 1]


def loss_gradients(
    mask: torch.Tensor, seed: int, shifted: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The actor loss's gradients and metrics; ``shifted`` positions get other log-probs and entropy."""
    generator = torch.Generator().manual_seed(seed)
    log_prob = torch.randn(mask.shape, generator=generator) - 2
    entropy = torch.rand(mask.shape, generator=generator)
    if shifted is not None:
        log_prob, entropy = log_prob - 3 * shifted, entropy + 3 * shifted
    log_prob, entropy = log_prob.requires_grad_(), entropy.requires_grad_()
    config = PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    loss, metrics = compute_actor_loss(
        log_prob=log_prob,
        old_log_prob=log_prob.detach() + 0.1 * torch.randn(mask.shape, generator=generator),
        advantages=torch.randn(mask.shape, generator=generator),
        response_mask=mask,
        config=config,
        counts=GlobalCounts(int(mask.sum()), mask.shape[0], 1, mask.shape[1]),
        entropy=entropy,
        ref_log_prob=log_prob.detach() - 0.2,
    )
    loss.backward()
    return log_prob.grad, entropy.grad, metrics


@pytest.mark.parametrize("broken", [False, True], ids=["response_mask", "environment_tokens_left_in"])
def test_no_environment_token_gets_a_gradient_kl_or_entropy(broken) -> None:
    mask, real = masks_of([[2, 3, 2], [1, 2, 3, 1, 1]])
    used = real if broken else mask  # the broken loop marks every real token as the model's
    log_prob_grad, entropy_grad, metrics = loss_gradients(used, 0)
    environment = real.bool() & ~mask.bool()
    leaked = bool(log_prob_grad[environment].any() or entropy_grad[environment].any())
    assert leaked == broken
    # Other log-probs and entropies on environment tokens change no metric (the loss's KL, entropy).
    _, _, shifted = loss_gradients(used, 0, shifted=environment.float())
    assert (metrics == shifted) != broken


def test_response_length_counts_model_tokens() -> None:
    mask, real = masks_of([[2, 3, 2], [1, 2, 3]])
    metrics = Timer().step_metrics(mask, epoch=0)
    assert metrics["response_length/mean"] == (4 + 4) / 2
