"""Descriptors of core's built-in algorithms, by import string (no torch import here)."""

from __future__ import annotations

from verl_core.descriptors import AdvantageEstimator, PolicyLoss

_ADV = "verl_core.algos.advantage"
ADVANTAGE_ESTIMATORS: tuple[AdvantageEstimator, ...] = (
    AdvantageEstimator(
        name="gae",
        function=f"{_ADV}:compute_gae_advantage_return",
        description="generalised advantage estimation with the critic's values (gamma, lam), whitened",
        needs_values=True,
    ),
    AdvantageEstimator(
        name="grpo",
        function=f"{_ADV}:compute_grpo_outcome_advantage",
        description="group-normalised outcome reward; Dr. GRPO with norm_adv_by_std_in_grpo=False",
        needs_groups=True,
    ),
    AdvantageEstimator(
        name="rloo",
        function=f"{_ADV}:compute_rloo_outcome_advantage",
        description="outcome reward minus the leave-one-out mean of its group",
        needs_groups=True,
    ),
    AdvantageEstimator(
        name="reinforce_plus_plus",
        function=f"{_ADV}:compute_reinforce_plus_plus_outcome_advantage",
        description="discounted returns (gamma), whitened over the batch",
    ),
    AdvantageEstimator(
        name="reinforce_plus_plus_baseline",
        function=f"{_ADV}:compute_reinforce_plus_plus_baseline_outcome_advantage",
        description="outcome reward minus its group mean, whitened over the batch",
    ),
    AdvantageEstimator(
        name="remax",
        function=f"{_ADV}:compute_remax_outcome_advantage",
        description="reward-to-go minus the greedy response's reward (reward_baselines)",
    ),
    AdvantageEstimator(
        name="opo",
        function=f"{_ADV}:compute_opo_outcome_advantage",
        description="outcome reward minus the length-weighted mean of its group",
    ),
    AdvantageEstimator(
        name="gpg",
        function=f"{_ADV}:compute_gpg_outcome_advantage",
        description="group-centred outcome reward rescaled by batch size / rewarded samples",
    ),
    AdvantageEstimator(
        name="grpo_passk",
        function=f"{_ADV}:compute_grpo_passk_outcome_advantage",
        description="pass@k: only each group's best sample is credited, by its margin over the second",
        needs_groups=True,
    ),
)
_PL = "verl_core.algos.policy_loss"
POLICY_LOSSES: tuple[PolicyLoss, ...] = (
    PolicyLoss(
        name="vanilla",
        function=f"{_PL}:compute_policy_loss_vanilla",
        description="PPO clipped surrogate, clip-higher (clip_ratio_low/high), dual-clip (clip_ratio_c)",
    ),
    PolicyLoss(
        name="gspo",
        function=f"{_PL}:compute_policy_loss_gspo",
        description="PPO clipping of the sequence-level (length-normalised) ratio, sequence mean",
    ),
    PolicyLoss(name="gpg", function=f"{_PL}:compute_policy_loss_gpg", description="plain -A log pi"),
    PolicyLoss(
        name="clip_cov",
        function=f"{_PL}:compute_policy_loss_clip_cov",
        description="PPO clip, plus detaching a few high-covariance tokens (clip_cov_ratio/lb/ub)",
    ),
    PolicyLoss(
        name="kl_cov",
        function=f"{_PL}:compute_policy_loss_kl_cov",
        description="-A r, plus ppo_kl_coef |log r| on the highest-covariance tokens (kl_cov_ratio)",
    ),
    PolicyLoss(
        name="geo_mean",
        function=f"{_PL}:compute_policy_loss_geo_mean",
        description="GMPO: geometric mean of token ratios per sequence, clipped in log space",
    ),
    PolicyLoss(
        name="cispo",
        function=f"{_PL}:compute_policy_loss_cispo",
        description="-sg(clip(r)) A log pi: clips the importance weight, keeps every gradient",
    ),
    PolicyLoss(
        name="dro",
        function=f"{_PL}:compute_policy_loss_dro",
        description="-(A log pi - dro_beta/2 (log r)^2): policy gradient with a quadratic log-ratio penalty",
    ),
    PolicyLoss(
        name="sapo",
        function=f"{_PL}:compute_policy_loss_sapo",
        description="soft gate (4/tau) sigmoid(tau (r - 1)) instead of clipping (tau_pos, tau_neg)",
    ),
)
