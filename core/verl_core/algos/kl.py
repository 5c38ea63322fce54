"""KL divergence between the policy and the reference: per-token estimators, controllers, KL in reward.

Per-token estimators of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens (Schulman 2020,
"Approximating KL divergence"), with ``d = log_prob - ref_log_prob``:

==============================  ====================================================================
name                            value
==============================  ====================================================================
``kl``, ``k1``                  ``d``
``abs``                         ``|d|``
``mse``, ``k2``                 ``d^2 / 2``
``low_var_kl``, ``k3``          ``exp(-d) + d - 1``, with ``-d`` clamped to [-20, 20] and the result
                                to [-10, 10]
``<name>+`` (``k1+``, ``k3+``)  the value of ``<name>`` with the gradient of ``k2`` (straight-through):
                                an unbiased gradient of the KL whatever the estimator used for its value
==============================  ====================================================================

The same estimators serve KL in the reward (``algorithm.kl_penalty``, ``apply_kl_penalty`` below)
and KL as a loss term (``actor.policy_loss.kl_loss_type``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import torch

from verl_core.algos.aggregation import masked_mean
from verl_core.config.algorithm import KL_PENALTIES, KLControlConfig
from verl_core.errors import did_you_mean

#: Bounds of k3 (``low_var_kl``) that keep it finite when the policies drift far apart.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    ref_over_policy = torch.clamp(-log_ratio, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    return torch.clamp(ref_over_policy.exp() - ref_over_policy - 1, min=-_K3_CLAMP, max=_K3_CLAMP)


#: The estimators by name: exactly ``verl_core.config.algorithm.KL_ESTIMATORS``, the names a config is
#: checked against when it loads (``KL_PENALTIES`` adds the ``+`` variants; a test holds them together).
_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy (``log_prob``) and the reference, by estimator name.

    Names are listed in ``KL_PENALTIES``; a name ending in ``+`` returns the named estimator's value
    with the gradient of ``k2`` (``log_prob - ref_log_prob`` with respect to ``log_prob``).
    """
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(
            f"unknown KL penalty {kl_penalty!r}{did_you_mean(kl_penalty, KL_PENALTIES)}: set algorithm.kl_penalty / "
            f"actor.policy_loss.kl_loss_type to one of {', '.join(KL_PENALTIES)}"
        )
    base_name, straight_through = kl_penalty.removesuffix("+"), kl_penalty.endswith("+")
    log_ratio = log_prob - ref_log_prob
    value = _ESTIMATORS[base_name](log_ratio)
    if not straight_through:
        return value
    surrogate = _k2(log_ratio)
    return surrogate - surrogate.detach() + value.detach()


# -- KL in the reward ----------------------------------------------------------------------------


class KLController(Protocol):
    """The coefficient of the KL penalty in the reward, updated once per step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...


@attrs.define
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt: the coefficient stays ``value``."""


@attrs.define
class AdaptiveKLController:
    """Steers the KL towards ``target_kl`` (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    ``value <- value * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon)``.
    """

    value: float
    target_kl: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient after a step of ``n_steps`` samples that measured ``current_kl``."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def build_kl_controller(config: KLControlConfig) -> KLController:
    """The controller ``algorithm.kl_ctrl`` describes, starting at ``kl_coef``."""
    if config.type == "fixed":
        return FixedKLController(value=config.kl_coef)
    if config.type == "adaptive":
        return AdaptiveKLController(value=config.kl_coef, target_kl=config.target_kl, horizon=config.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type: unknown controller {config.type!r}; use 'fixed' or 'adaptive'")


def apply_kl_penalty(
    *,
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty_name: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``rewards = scores - beta * KL`` per token, then update the controller.

    ``beta`` is ``kl_ctrl.value`` before the update. The step's KL, which drives the controller, is the
    mean over sequences with at least one response token of each sequence's mean per-token KL.
    Returns the token-level rewards and the metrics ``actor/reward_kl_penalty`` (that KL) and
    ``actor/reward_kl_penalty_coeff`` (``beta``).
    """
    mask = response_mask.bool()
    kl = torch.where(mask, kl_penalty(old_log_probs, ref_log_prob, kl_penalty_name), 0.0)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kl

    nonempty = mask.any(dim=-1)
    sequence_kl = masked_mean(kl, mask, dim=-1)
    current_kl = float(sequence_kl[nonempty].mean()) if bool(nonempty.any()) else 0.0
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
