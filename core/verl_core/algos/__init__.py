"""RL algorithms: advantage estimators, policy and value losses, KL, loss aggregation.

Every name below is importable from ``verl_core.algos`` and from its module; imports are lazy, so
that this package (and ``verl_core.algos.catalog``, read while a config loads) stays free of torch.
docs/algorithms.md documents each one.
"""

from verl_core.lazy import lazy_exports

_ADVANTAGE = "verl_core.algos.advantage"
_POLICY_LOSS = "verl_core.algos.policy_loss"
_AGGREGATION = "verl_core.algos.aggregation"
_KL = "verl_core.algos.kl"
_ROLLOUT_CORRECTION = "verl_core.algos.rollout_correction"

_EXPORTS = {
    # advantage estimators
    "compute_gae_advantage_return": _ADVANTAGE,
    "compute_grpo_outcome_advantage": _ADVANTAGE,
    "compute_grpo_passk_outcome_advantage": _ADVANTAGE,
    "compute_rloo_outcome_advantage": _ADVANTAGE,
    "compute_reinforce_plus_plus_outcome_advantage": _ADVANTAGE,
    "compute_reinforce_plus_plus_baseline_outcome_advantage": _ADVANTAGE,
    "compute_remax_outcome_advantage": _ADVANTAGE,
    "compute_opo_outcome_advantage": _ADVANTAGE,
    "compute_gpg_outcome_advantage": _ADVANTAGE,
    "masked_whiten": _ADVANTAGE,
    # policy losses
    "PolicyLossFn": _POLICY_LOSS,
    "compute_actor_loss": "verl_core.algos.actor_loss",
    "compute_policy_loss_vanilla": _POLICY_LOSS,
    "compute_policy_loss_gspo": _POLICY_LOSS,
    "compute_policy_loss_gpg": _POLICY_LOSS,
    "compute_policy_loss_clip_cov": _POLICY_LOSS,
    "compute_policy_loss_kl_cov": _POLICY_LOSS,
    "compute_policy_loss_geo_mean": _POLICY_LOSS,
    "compute_policy_loss_cispo": _POLICY_LOSS,
    "compute_policy_loss_dro": _POLICY_LOSS,
    "compute_policy_loss_sapo": _POLICY_LOSS,
    "rollout_log_prob_mismatch": _POLICY_LOSS,
    # rollout correction: the rollout's mismatch with the trainer, measured and corrected
    "RolloutCorrection": _ROLLOUT_CORRECTION,
    "compute_rollout_correction": _ROLLOUT_CORRECTION,
    "rollout_importance_weights": _ROLLOUT_CORRECTION,
    "rollout_mismatch_metrics": _ROLLOUT_CORRECTION,
    "rollout_rejection_mask": _ROLLOUT_CORRECTION,
    # on-policy distillation
    "reverse_kl_rewards": "verl_core.algos.distillation",
    "generalized_jsd": "verl_core.algos.distillation",
    "gkd_loss": "verl_core.algos.distillation",
    # value loss
    "compute_value_loss": "verl_core.algos.value_loss",
    # KL
    "kl_penalty": _KL,
    "apply_kl_penalty": _KL,
    "build_kl_controller": _KL,
    "KLController": _KL,
    "FixedKLController": _KL,
    "AdaptiveKLController": _KL,
    # aggregation
    "agg_loss": _AGGREGATION,
    "masked_mean": _AGGREGATION,
    "masked_sum": _AGGREGATION,
    "LOSS_AGG_MODES": _AGGREGATION,
    # lookups by name, through the plugin registry
    "get_advantage_estimator": "verl_core.algos.registry",
    "get_policy_loss": "verl_core.algos.registry",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
