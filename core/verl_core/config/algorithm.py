"""Options of the RL algorithms (verl's key names). Read by ``verl_core.algos``."""

from __future__ import annotations

import typing
from typing import Any, Literal

import attrs

from verl_core.config.names import registered
from verl_core.config.validators import greater_than, non_negative, one_of, positive, unit_interval
from verl_core.hookspecs import Kind

#: How per-token losses become one number; ``verl_core.algos.aggregation`` documents each mode. The
#: one list of their names: the config checks it, the algorithms name each mode from it.
LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = typing.get_args(LossAggMode)

#: The per-token KL estimators ``verl_core.algos.kl`` implements. Listed here, without torch, so that
#: a config is checked when it loads; ``verl_core.algos.kl`` computes exactly these.
KL_ESTIMATORS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: Every name ``algorithm.kl_penalty`` and ``actor.policy_loss.kl_loss_type`` accept: each estimator,
#: and each with a ``+`` suffix (its value with the gradient of ``k2``, straight-through).
KL_PENALTIES: tuple[str, ...] = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)
_kl_estimator = one_of(KL_PENALTIES, "KL estimator", "'+' keeps the value with the gradient of k2")


@attrs.define
class KLControlConfig:
    """KL-in-reward coefficient controller: ``fixed``, or ``adaptive`` (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = attrs.field(default=0.001, validator=non_negative)
    #: Adaptive controller only: the KL it steers towards, and its horizon in samples.
    target_kl: float = attrs.field(default=0.1, validator=positive)
    horizon: int = attrs.field(default=10000, validator=positive)


@attrs.define
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop the groups whose responses all scored the same (they carry no
    advantage for group estimators) and generate for more prompts until the batch is full."""

    enable: bool = False
    #: Generation rounds per step at most (the first included) before the step gives up with an error.
    max_num_gen_batches: int = attrs.field(default=10, validator=positive)


@attrs.define
class AlgorithmConfig:
    """The ``algorithm`` section: advantage estimation and KL in the reward."""

    #: Name of a registered advantage estimator (``verl-core plugins --all`` lists them).
    adv_estimator: str = registered(Kind.ADVANTAGE_ESTIMATORS, "gae")
    gamma: float = attrs.field(default=1.0, validator=unit_interval)
    lam: float = attrs.field(default=1.0, validator=unit_interval)
    #: GRPO: divide by the group's std (False gives Dr.GRPO).
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    #: KL estimator of the penalty (``KL_PENALTIES``).
    kl_penalty: str = attrs.field(default="kl", validator=_kl_estimator)
    kl_ctrl: KLControlConfig = attrs.field(factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = attrs.field(factory=FilterGroupsConfig)
    #: Options for plugin-provided estimators, passed through untouched.
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class PolicyLossConfig:
    """The actor's loss: which policy loss, its clipping, aggregation, entropy and KL terms."""

    #: Name of a registered policy loss; ``vanilla`` is PPO's clipped surrogate.
    loss_mode: str = registered(Kind.POLICY_LOSSES, "vanilla")
    loss_agg_mode: LossAggMode = "token-mean"
    clip_ratio: float = attrs.field(default=0.2, validator=non_negative)
    #: Asymmetric clipping (DAPO's clip-higher); ``None`` falls back to ``clip_ratio``.
    clip_ratio_low: float | None = attrs.field(default=None, validator=non_negative)
    clip_ratio_high: float | None = attrs.field(default=None, validator=non_negative)
    #: Dual-clip lower bound for negative advantages (must be > 1).
    clip_ratio_c: float = attrs.field(default=3.0, validator=greater_than(1))
    entropy_coeff: float = attrs.field(default=0.0, validator=non_negative)
    use_kl_loss: bool = False
    kl_loss_coef: float = attrs.field(default=0.001, validator=non_negative)
    #: KL estimator of the loss term (``KL_PENALTIES``).
    kl_loss_type: str = attrs.field(default="low_var_kl", validator=_kl_estimator)
    #: Truncated importance weights from rollout log-probs: cap of the weight, ``None`` disables.
    rollout_is_cap: float | None = attrs.field(default=None, validator=positive)
    #: Clip-Cov: fraction of tokens to detach, and the covariance band they are drawn from.
    clip_cov_ratio: float = attrs.field(default=0.0002, validator=unit_interval)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    #: KL-Cov: fraction of highest-covariance tokens that get the |log-ratio| penalty, and its weight.
    kl_cov_ratio: float = attrs.field(default=0.0002, validator=unit_interval)
    ppo_kl_coef: float = attrs.field(default=1.0, validator=non_negative)
    #: SAPO: temperatures of the soft gate for positive and negative advantages.
    tau_pos: float = attrs.field(default=1.0, validator=positive)
    tau_neg: float = attrs.field(default=1.05, validator=positive)
    #: DRO: weight of the quadratic log-ratio penalty.
    dro_beta: float = attrs.field(default=1.0, validator=non_negative)
    #: Options for plugin-provided losses, passed through untouched.
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class CriticLossConfig:
    """The critic's clipped value loss."""

    cliprange_value: float = attrs.field(default=0.5, validator=positive)
    loss_agg_mode: LossAggMode = "token-mean"
