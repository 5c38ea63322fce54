"""Decoupled PPO (Hilton et al. 2022; AReaL), what an off-policy step computes: PPO's ratio and clip
against the *proximal* policy (the old log-probs the engine recomputes before the update), times the
importance weight of the proximal policy over the *behaviour* policy (the rollout's log-probs, a few
versions stale), truncated (``rollout_correction.rollout_is: token``). Checked against the formula
written out on hypothesis-generated batches; a loss that takes the behaviour log-probs where the
proximal ones belong fails it."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algos import compute_actor_loss
from verl_core.config import PolicyLossConfig, RolloutCorrectionConfig
from verl_core.data import GlobalCounts

CLIP, CLIP_C, CAP = 0.2, 3.0, 2.0


def decoupled_ppo_reference(log_prob, proximal, behaviour, advantages, mask) -> torch.Tensor:
    """The token-mean of ``w * max(-A r, -A clip(r))``, dual-clipped at ``-A c`` for ``A < 0``, with
    ``r = pi / pi_prox`` and ``w = min(pi_prox / pi_behav, cap)``, over the tokens of ``mask``."""
    total, count = 0.0, 0
    rows, width = log_prob.shape
    for i in range(rows):
        for t in range(width):
            if not mask[i, t]:
                continue
            a = float(advantages[i, t])
            r = float(torch.exp(log_prob[i, t] - proximal[i, t]))
            w = min(float(torch.exp(proximal[i, t] - behaviour[i, t])), CAP)
            loss = max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP))
            if a < 0:
                loss = min(loss, -a * CLIP_C)
            total, count = total + w * loss, count + 1
    return torch.tensor(total / max(count, 1))


def decoupled(proximal_from_behaviour: bool = False):
    """The actor's loss as an off-policy step computes it; the broken variant takes the behaviour
    log-probs for the proximal ones (the ratio then measures the staleness too, and clips it)."""
    config = PolicyLossConfig(
        clip_ratio=CLIP,
        clip_ratio_c=CLIP_C,
        rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=CAP),
    )

    def loss(log_prob, proximal, behaviour, advantages, mask):
        counts = GlobalCounts(int(mask.sum()), mask.shape[0], 1, mask.shape[1])
        value, _ = compute_actor_loss(
            log_prob=log_prob,
            old_log_prob=behaviour if proximal_from_behaviour else proximal,
            advantages=advantages,
            response_mask=mask,
            config=config,
            counts=counts,
            rollout_log_probs=behaviour,
        )
        return value

    return loss


log_probs = st.floats(-4.0, -0.05)


@st.composite
def off_policy_batches(draw):
    rows, width = draw(st.integers(1, 4)), draw(st.integers(1, 6))

    def tensor(elements):
        return torch.tensor(draw(st.lists(elements, min_size=rows * width, max_size=rows * width))).view(
            rows, width
        )

    proximal = tensor(log_probs).double()
    # The behaviour policy a few versions back, the current one a few optimiser steps on.
    behaviour = proximal + tensor(st.floats(-1.0, 1.0)).double()
    log_prob = proximal + tensor(st.floats(-0.5, 0.5)).double()
    advantages = tensor(st.floats(-2.0, 2.0)).double()
    mask = tensor(st.sampled_from([0, 1]))
    mask[0, 0] = 1
    return log_prob, proximal, behaviour, advantages, mask


@settings(max_examples=60, deadline=None)
@given(off_policy_batches())
def test_decoupled_ppo_is_its_formula(batch) -> None:
    assert decoupled()(*batch).item() == pytest.approx(
        decoupled_ppo_reference(*batch).item(), rel=1e-6, abs=1e-9
    )


def test_the_behaviour_log_probs_in_the_proximal_ones_place_fail_the_formula() -> None:
    # Where neither the clip nor the cap applies the two agree (r w = pi / pi_behav); here the policy
    # moved past the clip from the proximal policy, and not from the behaviour policy.
    log_prob = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64)
    proximal = torch.tensor([[-1.5, -0.9, -1.6]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.2, -0.6, -1.9]], dtype=torch.float64)  # stale by a few versions
    advantages = torch.tensor([[1.0, -1.0, 0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.int64)
    batch = (log_prob, proximal, behaviour, advantages, mask)
    expected = decoupled_ppo_reference(*batch).item()
    assert decoupled()(*batch).item() == pytest.approx(expected, rel=1e-6)
    assert decoupled(proximal_from_behaviour=True)(*batch).item() != pytest.approx(expected, rel=1e-3)


def test_an_off_policy_mode_recomputes_the_proximal_log_probs(demo, tmp_path) -> None:
    from fixtures.demo import run_overrides

    from verl_core.config import OldLogProbsSource, load_config

    for mode, source in (("sync", OldLogProbsSource.ROLLOUT), ("one_step_off", OldLogProbsSource.ENGINE)):
        overrides = run_overrides(
            demo, tmp_path, **{"rollout.placement": "separate", "async_training.mode": mode}
        )
        assert load_config([], overrides).old_log_probs_source(1) is source, mode
    config = load_config([], run_overrides(demo, tmp_path, **{"rollout.placement": "separate"}))
    config = attrs.evolve(
        config, async_training=attrs.evolve(config.async_training, mode="async", max_staleness=0)
    )
    assert config.old_log_probs_source(1) is OldLogProbsSource.ROLLOUT  # staleness 0: the sync run's
