"""Policy losses of the actor (the actor's total loss, with entropy and KL terms, is ``actor_loss``).

Every policy loss has the same keyword-only signature, so that the actor calls any of them, built-in
or plugin-provided, by name (``actor.policy_loss.loss_mode``) in the same way::

    fn(*, old_log_prob, log_prob, advantages, response_mask, config: PolicyLossConfig,
       counts: GlobalCounts, rollout_log_probs=None) -> (loss, metrics)

All tensors are padded ``[batch, response_len]``: ``log_prob`` (the current policy, carries the
gradient), ``old_log_prob`` (the behaviour policy as recomputed by the training engine),
``advantages``, ``response_mask`` (1 on tokens that count) and, optionally, ``rollout_log_probs``
(the behaviour policy as the rollout engine computed it). ``loss`` is a scalar, this micro-batch's
share of the step's loss, aggregated with ``verl_core.algos.aggregation.agg_loss`` over the step's
global ``counts``; ``metrics`` maps names to floats computed over this micro-batch
(``actor/ppo_kl``: the k1 estimate of KL(old || new); ``actor/pg_clipfrac`` /
``actor/pg_clipfrac_lower``: fractions of tokens clipped, where the loss clips).

With importance weights on (``config.rollout_correction.rollout_is``, or the deprecated
``config.rollout_is_cap``), every loss here multiplies its per-token loss by the weights of
``verl_core.algos.rollout_correction.rollout_importance_weights`` (no gradient: ``pi_old / pi_rollout``
per token or per sequence, truncated or masked), correcting for the rollout engine sampling from a
slightly different distribution than the trainer computes; ``rollout_log_prob_mismatch`` and
``rollout_correction.rollout_mismatch_metrics`` measure how different.

Formulas and papers: docs/algorithms.md.
"""

from __future__ import annotations

from typing import Protocol

import torch

from verl_core.algos.aggregation import SEQ_MEAN_TOKEN_MEAN, agg_loss, check_loss_agg_mode, masked_mean
from verl_core.algos.rollout_correction import MAX_LOG_RATIO, rollout_importance_weights
from verl_core.config.algorithm import PolicyLossConfig
from verl_core.data.batch import GlobalCounts
from verl_core.deprecation import moved_names

#: GSPO's sequence log-ratio is clamped from above before ``exp``.
MAX_SEQ_LOG_RATIO = 10.0


class PolicyLossFn(Protocol):
    """The signature every policy loss implements (see the module docstring)."""

    def __call__(
        self,
        *,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        config: PolicyLossConfig,
        counts: GlobalCounts,
        rollout_log_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


# -- shared pieces -------------------------------------------------------------------------------


def clip_bounds(config: PolicyLossConfig) -> tuple[float, float]:
    """``(low, high)``: the ratio is clipped to ``[1 - low, 1 + high]``; each defaults to ``clip_ratio``."""
    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    return low, high


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def rollout_log_prob_mismatch(
    *, old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout's log-probs of its sampled tokens are from the training engine's, over the
    tokens ``response_mask`` sets (environment tokens and padding never count); 0 with none set.

    With ``d_t = |old_log_prob_t - rollout_log_probs_t|`` over the set tokens:
    ``rollout/log_prob_diff_mean`` is the mean of ``d_t``, ``rollout/log_prob_diff_max`` its largest
    value, and ``rollout/prob_diff_mean`` the mean of ``|exp(old_log_prob_t) - exp(rollout_log_probs_t)|``.
    ``old_log_prob`` must be recomputed before any update (the weights the rollout sampled with):
    the numbers then differ only by how the two compute (a rollout in another dtype, ``rollout.dtype``;
    another inference engine), which is the gap truncated importance sampling corrects.
    """
    mask = response_mask.bool()
    with torch.no_grad():
        diff = torch.where(mask, (old_log_prob - rollout_log_probs).abs(), 0.0)
        prob_diff = (old_log_prob.exp() - rollout_log_probs.exp()).abs()
        return {
            "rollout/log_prob_diff_mean": float(masked_mean(diff, mask)),
            "rollout/log_prob_diff_max": float(diff.max()),
            "rollout/prob_diff_mean": float(masked_mean(prob_diff, mask)),
        }


def _finish(
    pg_losses: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    config: PolicyLossConfig,
    counts: GlobalCounts,
    response_mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    loss_agg_mode: str | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Apply rollout importance weights to the per-token loss, aggregate it (with ``loss_agg_mode``,
    by default the configured one), turn the metrics into floats."""
    # Checked even by losses that fix their own mode, so that a typo in the config never goes unnoticed.
    check_loss_agg_mode(config.loss_agg_mode, key="actor.policy_loss.loss_agg_mode")
    weights, weight_metrics = rollout_importance_weights(
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
        config=config,
    )
    if weights is not None:
        pg_losses = pg_losses * weights
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode or config.loss_agg_mode, counts)
    metrics = {**metrics, **weight_metrics}
    # One device-to-host transfer for all metrics.
    values = torch.stack([value.detach().float() for value in metrics.values()]).tolist()
    return loss, dict(zip(metrics, values, strict=True))


def _ppo_kl(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """k1 estimate of KL(pi_old || pi) over the micro-batch's tokens."""
    return masked_mean(-log_ratio.detach(), response_mask)


# -- losses --------------------------------------------------------------------------------------


def compute_policy_loss_vanilla(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate with asymmetric clipping (clip-higher) and dual-clip.

    Per token ``max(-A r, -A clip(r, 1 - low, 1 + high))``; for ``A < 0`` further capped at
    ``-A * clip_ratio_c`` (dual-clip), so that a token whose ratio exploded cannot dominate the loss.
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    surrogate = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    ppo_losses = torch.maximum(surrogate, clipped)
    dual_bound = -advantages * config.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(ppo_losses, dual_bound), ppo_losses)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > surrogate).float(), response_mask),
        "actor/pg_clipfrac_lower": masked_mean((negative & (ppo_losses > dual_bound)).float(), response_mask),
        "actor/ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return _finish(pg_losses, metrics, config, counts, response_mask, old_log_prob, rollout_log_probs)


def compute_policy_loss_gspo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO clipping applied to the sequence-level ratio ``s = exp(mean_t log r_t)``.

    Written token by token as ``s_t = sg(s) * pi(y_t) / sg(pi(y_t))`` (value ``s``, gradient of
    ``s * log pi(y_t)``), which lets advantages vary per token; with a per-sequence advantage it is
    exactly the paper's sequence objective. Always aggregated ``seq-mean-token-mean`` (the paper's
    sequence mean); ``loss_agg_mode`` is not used. The paper's clip ranges are small (3e-4 / 4e-4).
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    seq_log_ratio = masked_mean(log_ratio.detach(), response_mask, dim=-1).unsqueeze(-1)
    token_seq_log_ratio = log_prob - log_prob.detach() + seq_log_ratio
    seq_ratio = token_seq_log_ratio.clamp(max=MAX_SEQ_LOG_RATIO).exp()
    surrogate = -advantages * seq_ratio
    clipped = -advantages * seq_ratio.clamp(1.0 - low, 1.0 + high)
    pg_losses = torch.maximum(surrogate, clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > surrogate).float(), response_mask),
        "actor/ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return _finish(
        pg_losses,
        metrics,
        config,
        counts,
        response_mask,
        old_log_prob,
        rollout_log_probs,
        loss_agg_mode=SEQ_MEAN_TOKEN_MEAN,
    )


def compute_policy_loss_gpg(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG: the plain policy gradient ``-A log pi`` (no ratio, no clipping)."""
    pg_losses = -advantages * log_prob
    metrics = {"actor/ppo_kl": _ppo_kl(_log_ratio(log_prob, old_log_prob), response_mask)}
    return _finish(pg_losses, metrics, config, counts, response_mask, old_log_prob, rollout_log_probs)


@torch.no_grad()
def _centred_covariance(
    advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token ``(A - mean A) * (log pi - mean log pi)``, means over the micro-batch's tokens."""
    return (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob, response_mask)
    )


def _num_selected(ratio: float, num_tokens: int) -> int:
    """``ratio`` of ``num_tokens``, at least one unless the ratio or the token count is zero."""
    if ratio <= 0 or num_tokens == 0:
        return 0
    return max(int(ratio * num_tokens), 1)


def compute_policy_loss_clip_cov(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: PPO's clipped surrogate, plus detaching a few tokens of high covariance.

    Tokens that PPO does not clip and whose covariance ``(A - mean A)(log pi - mean log pi)`` lies in
    ``(clip_cov_lb, clip_cov_ub)`` are candidates; ``clip_cov_ratio`` of the micro-batch's tokens are
    drawn from them at random (``torch``'s global generator) and contribute neither loss nor gradient.
    Covariance and selection are per micro-batch, as in the paper's implementation.
    """
    low, high = clip_bounds(config)
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    surrogate = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    with torch.no_grad():
        covariance = _centred_covariance(advantages, log_prob, mask)
        candidates = mask & (clipped <= surrogate)
        candidates &= (covariance > config.clip_cov_lb) & (covariance < config.clip_cov_ub)
        candidate_positions = candidates.nonzero()
        num_detached = min(
            _num_selected(config.clip_cov_ratio, int(mask.sum())), candidate_positions.shape[0]
        )
        drawn = torch.randperm(candidate_positions.shape[0], device=mask.device)[:num_detached]
        detached = torch.zeros_like(mask)
        detached[tuple(candidate_positions[drawn].T)] = True
    pg_losses = torch.where(detached, torch.zeros_like(surrogate), torch.maximum(surrogate, clipped))
    metrics = {
        "actor/pg_clipfrac": masked_mean(detached.float(), mask),
        "actor/ppo_kl": _ppo_kl(log_ratio, mask),
    }
    return _finish(pg_losses, metrics, config, counts, response_mask, old_log_prob, rollout_log_probs)


def compute_policy_loss_kl_cov(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: the unclipped surrogate ``-A r``, plus ``ppo_kl_coef * |log r|`` on the
    ``kl_cov_ratio`` fraction of the micro-batch's tokens with the largest covariance
    ``(A - mean A)(log pi - mean log pi)``. No ratio clipping."""
    mask = response_mask.bool()
    log_ratio = _log_ratio(log_prob, old_log_prob)
    surrogate = -advantages * log_ratio.exp()
    with torch.no_grad():
        covariance = _centred_covariance(advantages, log_prob, mask)
        num_penalised = _num_selected(config.kl_cov_ratio, int(mask.sum()))
        scores = covariance.masked_fill(~mask, float("-inf")).flatten()
        penalised = torch.zeros_like(scores, dtype=torch.bool)
        penalised[scores.topk(num_penalised).indices] = True
        penalised = penalised.view_as(mask)
    pg_losses = torch.where(penalised, surrogate + config.ppo_kl_coef * log_ratio.abs(), surrogate)
    metrics = {
        "actor/pg_clipfrac": masked_mean(penalised.float(), mask),
        "actor/ppo_kl": _ppo_kl(log_ratio, mask),
    }
    return _finish(pg_losses, metrics, config, counts, response_mask, old_log_prob, rollout_log_probs)


def compute_policy_loss_geo_mean(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO: maximise the geometric mean of token ratios per sequence, clipped in log space.

    Each token's log-ratio is clipped to ``[-low, high]`` in the pessimistic direction only (from above
    for ``A > 0``, from below for ``A < 0``); the sequence ratio is ``exp`` of their mean; the sequence
    loss ``-mean_t(A) * ratio`` is averaged over sequences (``seq-mean-token-mean``; ``loss_agg_mode`` is
    not used). Note the clip range is in log space (the paper uses 0.4 on both sides).
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    sign = torch.sign(advantages)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * log_ratio.clamp(-low, high))
    seq_ratio = masked_mean(clipped_log_ratio, response_mask, dim=-1).exp()
    seq_advantage = masked_mean(advantages, response_mask, dim=-1)
    seq_losses = -seq_advantage * seq_ratio
    pg_losses = seq_losses.unsqueeze(-1).expand_as(log_prob)
    metrics = {
        "actor/pg_clipfrac": masked_mean(((advantages > 0) & (log_ratio > high)).float(), response_mask),
        "actor/pg_clipfrac_lower": masked_mean(
            ((advantages < 0) & (log_ratio < -low)).float(), response_mask
        ),
        "actor/ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return _finish(
        pg_losses,
        metrics,
        config,
        counts,
        response_mask,
        old_log_prob,
        rollout_log_probs,
        loss_agg_mode=SEQ_MEAN_TOKEN_MEAN,
    )


def compute_policy_loss_cispo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi``.

    Clips the importance weight, not the update: every token keeps a gradient, scaled by its clipped
    weight. The paper bounds only from above (set a large ``clip_ratio_low``).
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    weights = ratio.clamp(1.0 - low, 1.0 + high).detach()
    pg_losses = -advantages * weights * log_prob
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio > 1.0 + high).float(), response_mask),
        "actor/pg_clipfrac_lower": masked_mean((ratio < 1.0 - low).float(), response_mask),
        "actor/ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return _finish(pg_losses, metrics, config, counts, response_mask, old_log_prob, rollout_log_probs)


def compute_policy_loss_dro(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO: ``-(A log pi - dro_beta / 2 * (log pi - log pi_old)^2)``, a policy gradient with a
    quadratic penalty on the log-ratio instead of clipping."""
    log_ratio = log_prob - old_log_prob
    pg_losses = -(advantages * log_prob - 0.5 * config.dro_beta * log_ratio.square())
    metrics = {"actor/ppo_kl": _ppo_kl(log_ratio, response_mask)}
    return _finish(pg_losses, metrics, config, counts, response_mask, old_log_prob, rollout_log_probs)


def compute_policy_loss_sapo(
    *,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    counts: GlobalCounts,
    rollout_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: a smooth gate instead of hard clipping, ``-A * (4 / tau) * sigmoid(tau * (r - 1))``.

    ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``. The gate's slope is 1 at ``r = 1`` (the plain
    policy gradient on policy) and decays smoothly as the ratio moves away. Always aggregated
    ``seq-mean-token-mean``, as verl does; ``loss_agg_mode`` is not used.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    # Tensors of the ratio's dtype: python scalars would make ``where`` round tau to float32.
    tau = torch.where(advantages > 0, ratio.new_tensor(config.tau_pos), ratio.new_tensor(config.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -advantages * gate
    metrics = {
        "actor/sapo_gate_mean": masked_mean(gate.detach(), response_mask),
        "actor/ppo_kl": _ppo_kl(log_ratio, response_mask),
    }
    return _finish(
        pg_losses,
        metrics,
        config,
        counts,
        response_mask,
        old_log_prob,
        rollout_log_probs,
        loss_agg_mode=SEQ_MEAN_TOKEN_MEAN,
    )


# First defined here; its home is the algorithms' face (importing it from here would be a cycle:
# it calls the policy losses defined here).
__getattr__ = moved_names(
    __name__,
    {"compute_actor_loss": "verl_core.algos:compute_actor_loss"},
    since="0.2.0",
    removed_in="0.4.0",
)
