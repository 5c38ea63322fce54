"""The actor's total loss: the configured policy loss, minus the entropy bonus, plus the KL loss to
the reference policy, each aggregated over the step's global counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verl_core.algos.aggregation import agg_loss, masked_mean
from verl_core.algos.kl import kl_penalty
from verl_core.algos.registry import get_policy_loss
from verl_core.config.algorithm import PolicyLossConfig
from verl_core.data.batch import REF_LOG_PROB, GlobalCounts
from verl_core.plugins import Registry

if TYPE_CHECKING:  # policy_loss imports this module back; the protocol is only an annotation here
    from verl_core.algos.policy_loss import PolicyLossFn


def compute_actor_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    entropy: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    registry: Registry | None = None,
    policy_loss: PolicyLossFn | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss: ``policy loss - entropy_coeff * entropy + kl_loss_coef * KL(pi || pi_ref)``.

    The policy loss is ``policy_loss`` when given (what a caller resolved once, e.g. with
    ``verl_core.algos.get_policy_loss``), else the one registered as ``config.loss_mode`` in
    ``registry`` (default: the process-wide registry), looked up at each call. The entropy and KL terms are aggregated like the
    policy loss (``config.loss_agg_mode``, global counts); the KL term, when ``config.use_kl_loss``,
    uses the ``config.kl_loss_type`` estimator of ``verl_core.algos.kl``. Metrics add the micro-batch's
    means ``actor/entropy`` and ``actor/kl_loss``.
    """
    if policy_loss is None:
        policy_loss = get_policy_loss(config.loss_mode, registry)
    loss, metrics = policy_loss(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        config=config,
        counts=counts,
        rollout_log_probs=rollout_log_probs,
    )
    if config.entropy_coeff != 0:
        if entropy is None:
            raise ValueError(
                f"actor.policy_loss.entropy_coeff={config.entropy_coeff} needs the policy's per-token "
                "entropy: run the forward pass with compute_entropy=True, or set entropy_coeff to 0"
            )
        loss = loss - config.entropy_coeff * agg_loss(entropy, response_mask, config.loss_agg_mode, counts)
        metrics["actor/entropy"] = masked_mean(entropy.detach(), response_mask).item()
    if config.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError(
                "actor.policy_loss.use_kl_loss=True needs the reference policy's log-probs (batch key "
                f"'{REF_LOG_PROB}'): enable the reference model, or set use_kl_loss to false"
            )
        kl = kl_penalty(log_prob, ref_log_prob, config.kl_loss_type)
        loss = loss + config.kl_loss_coef * agg_loss(kl, response_mask, config.loss_agg_mode, counts)
        metrics["actor/kl_loss"] = masked_mean(kl.detach(), response_mask).item()
    return loss, metrics
