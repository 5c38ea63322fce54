"""Options of the RL algorithms (verl's key names). Read by ``verl_core.algos``."""

from __future__ import annotations

from typing import Any, Literal

import attrs


@attrs.define
class KLControlConfig:
    """KL-in-reward coefficient controller: ``fixed``, or ``adaptive`` (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    #: Adaptive controller only: the KL it steers towards, and its horizon in samples.
    target_kl: float = 0.1
    horizon: int = 10000


@attrs.define
class AlgorithmConfig:
    """The ``algorithm`` section: advantage estimation and KL in the reward."""

    #: Name of a registered advantage estimator (``verl-core plugins`` lists them).
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    #: GRPO: divide by the group's std (False gives Dr.GRPO).
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = attrs.field(factory=KLControlConfig)
    #: Options for plugin-provided estimators, passed through untouched.
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class PolicyLossConfig:
    """The actor's loss: which policy loss, its clipping, aggregation, entropy and KL terms."""

    #: Name of a registered policy loss; ``vanilla`` is PPO's clipped surrogate.
    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    #: Asymmetric clipping (DAPO's clip-higher); ``None`` falls back to ``clip_ratio``.
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    #: Dual-clip lower bound for negative advantages (must be > 1).
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    #: Truncated importance weights from rollout log-probs: cap of the weight, ``None`` disables.
    rollout_is_cap: float | None = None
    #: Options for plugin-provided losses, passed through untouched.
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class CriticLossConfig:
    """The critic's clipped value loss."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
