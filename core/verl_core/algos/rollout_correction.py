"""Rollout correction: how far the rollout's log-probs are from the training engine's, and what weighs or
rejects tokens for it (verl's ``rollout_corr``, configured by ``actor.policy_loss.rollout_correction``).

A rollout that is not bitwise the trainer (another inference engine, another dtype) samples each response
token ``y_t`` from its own ``pi_rollout`` while the engine computes ``pi_old``. Over the tokens
``response_mask`` sets, with the log-ratio ``l_t = log pi_old(y_t) - log pi_rollout(y_t)`` and the
ratio ``r_t = exp(l_t)``:

- ``rollout_mismatch_metrics``: the disagreement, ``rollout_corr/*`` (K3 KL, perplexities, chi-square,
  effective sample sizes), logged every step that has the rollout's log-probs;
- ``rollout_importance_weights``: the weights a policy loss multiplies its per-token loss by
  (truncated, or masked outside bounds; per token or per sequence), recomputed per micro-batch (every
  weight depends on its own row only);
- ``rollout_rejection_mask``: the tokens or sequences that leave the loss altogether;
- ``compute_rollout_correction``: all three for a whole batch, as the trainer runs them once a step.

Every ``exp`` takes a log-ratio clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]`` (verl's safety bound),
so that no ratio overflows. Sequence statistics average over the sequences with at least one token set.
Names and formulas follow verl 0.9's ``verl/trainer/ppo/rollout_corr_helper.py`` where they overlap;
docs/algorithms.md lists where they differ.
"""

from __future__ import annotations

import math

import attrs
import torch

from verl_core.algos.aggregation import masked_mean, masked_sum
from verl_core.config.algorithm import Bounds, PolicyLossConfig

#: Log-ratios are clamped to this before ``exp``: no weight, however far off-policy, overflows.
MAX_LOG_RATIO = 20.0
#: The prefix of every metric here (verl's).
PREFIX = "rollout_corr/"

#: The metrics of ``rollout_mismatch_metrics`` with no token to measure: no mismatch seen.
_NO_MISMATCH = {
    "kl": 0.0,
    "k3_kl": 0.0,
    "training_ppl": 1.0,
    "training_log_ppl": 0.0,
    "rollout_ppl": 1.0,
    "rollout_log_ppl": 0.0,
    "log_ppl_diff": 0.0,
    "log_ppl_abs_diff": 0.0,
    "log_ppl_diff_max": 0.0,
    "log_ppl_diff_min": 0.0,
    "ppl_ratio": 1.0,
    "chi2_token": 0.0,
    "chi2_seq": 0.0,
    "ess_token": 1.0,
    "ess_seq": 1.0,
}


def _floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """``rollout_corr/<name>``: each value as a float."""
    return {PREFIX + name: float(value) for name, value in metrics.items()}


def _clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _normalised_ess(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(sum w)^2 / (n sum w^2)`` over the entries ``mask`` sets: 1 for equal weights, ``1/n`` for one
    weight carrying everything; 0 when every weight is 0 (nothing left to learn from)."""
    mean = masked_mean(weights, mask)
    mean_square = masked_mean(weights.square(), mask)
    return torch.where(
        mean_square > 0, mean.square() / mean_square.clamp(min=torch.finfo(mean.dtype).tiny), 0.0
    )


def rollout_mismatch_metrics(
    *, old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far ``rollout_log_probs`` are from ``old_log_prob`` (the training engine's, same weights),
    over the tokens ``response_mask`` sets, as ``rollout_corr/<name>`` (verl's names):

    - ``kl``: ``mean_t(-l_t)``, the k1 estimate of ``KL(pi_rollout || pi_old)`` (the tokens were
      sampled from ``pi_rollout``); ``k3_kl``: ``mean_t(r_t - 1 - l_t)``, its non-negative k3 estimate;
    - ``training_ppl`` / ``rollout_ppl``: the mean over sequences of ``exp(-mean_t log p_t)``;
      ``training_log_ppl`` / ``rollout_log_ppl``: of ``-mean_t log p_t``;
    - ``log_ppl_diff``: the mean over sequences of ``d = mean_t log pi_rollout - mean_t log pi_old``
      (``log(training_ppl / rollout_ppl)`` per sequence), ``log_ppl_abs_diff`` of ``|d|``,
      ``log_ppl_diff_max`` / ``_min`` its extremes, ``ppl_ratio`` the mean of ``exp(d)``;
    - ``chi2_token``: ``mean_t(r_t^2) - 1``; ``chi2_seq``: the mean over sequences of ``R^2`` minus 1,
      with ``R = exp(sum_t l_t)`` the sequence's ratio (chi-square divergences of ``pi_old`` from
      ``pi_rollout``: how much importance weights would vary);
    - ``ess_token`` / ``ess_seq``: the normalised effective sample size ``(sum w)^2 / (n sum w^2)`` of
      the token ratios ``r_t`` / the sequence ratios ``R``, in ``(0, 1]``: the fraction of the batch
      that importance sampling would effectively keep.

    With no token set: no mismatch (0, and 1 for the perplexities, their ratio and the sample sizes).
    """
    # On the CPU in float64 (a micro-batch's [batch, response_len], on any device; MPS has no float64):
    # sums of squared weights stay exact, and reading the floats waits for no device.
    mask = response_mask.detach().to("cpu").bool()
    if not bool(mask.any()):
        return _floats(dict(_NO_MISMATCH))
    with torch.no_grad():
        old = torch.where(mask, old_log_prob.detach().to("cpu", torch.float64), 0.0)
        rollout = torch.where(mask, rollout_log_probs.detach().to("cpu", torch.float64), 0.0)
        log_ratio = old - rollout
        clamped = _clamped(log_ratio)
        rows = mask.any(dim=-1)
        old_mean = masked_mean(old, mask, dim=-1)
        rollout_mean = masked_mean(rollout, mask, dim=-1)
        ppl_diff = rollout_mean - old_mean
        seq_log_ratio = _clamped(masked_sum(log_ratio, mask, dim=-1))
        metrics = {
            "kl": masked_mean(-log_ratio, mask),
            "k3_kl": masked_mean(clamped.exp() - 1.0 - clamped, mask),
            "training_ppl": masked_mean((-old_mean).exp(), rows),
            "training_log_ppl": masked_mean(-old_mean, rows),
            "rollout_ppl": masked_mean((-rollout_mean).exp(), rows),
            "rollout_log_ppl": masked_mean(-rollout_mean, rows),
            "log_ppl_diff": masked_mean(ppl_diff, rows),
            "log_ppl_abs_diff": masked_mean(ppl_diff.abs(), rows),
            "log_ppl_diff_max": ppl_diff[rows].max(),
            "log_ppl_diff_min": ppl_diff[rows].min(),
            "ppl_ratio": masked_mean(ppl_diff.exp(), rows),
            "chi2_token": masked_mean((2.0 * clamped).exp(), mask) - 1.0,
            "chi2_seq": masked_mean((2.0 * seq_log_ratio).exp(), rows) - 1.0,
            "ess_token": _normalised_ess(clamped.exp(), mask),
            "ess_seq": _normalised_ess(seq_log_ratio.exp(), rows),
        }
    return _floats(metrics)


# -- importance weights ----------------------------------------------------------------------------


@attrs.frozen
class _ImportanceWeights:
    """Importance weights of a batch: ``weights`` (what the loss multiplies by, 0 off the mask), the
    ``raw`` ratios they come from (``r_t``, or the sequence's ``R`` on each of its tokens), the
    sequences' log-ratios ``log R`` unclamped (``[B, 1]``), the ``level`` (``token`` or ``sequence``)
    and the ``bounds`` (masking with a ``lower`` bound, truncation at ``upper`` without)."""

    weights: torch.Tensor
    raw: torch.Tensor
    sequence_log_ratio: torch.Tensor
    level: str
    bounds: Bounds

    @property
    def masking(self) -> bool:
        return self.bounds.lower is not None


def _importance_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, bounds: Bounds
) -> _ImportanceWeights:
    """The weights of ``log_ratio`` (``l_t``, no gradient): per ``token`` ``r_t``, per ``sequence``
    ``R = exp(sum_t l_t)`` on each of its tokens; truncated at ``bounds.upper`` (TIS) or, with a
    ``bounds.lower``, set to 0 outside ``[lower, upper]`` (masking: IcePop per token, TRL's
    ``sequence_mask`` per sequence); 0 where ``response_mask`` is not set."""
    mask = response_mask.bool()
    with torch.no_grad():
        log_ratio = torch.where(mask, log_ratio.detach(), 0.0)
        sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True)
        if level == "token":
            log_weights = _clamped(log_ratio)
        elif level == "sequence":
            log_weights = _clamped(sequence_log_ratio).expand_as(log_ratio)
        else:
            raise ValueError(f"rollout_is={level!r}: use 'token' or 'sequence'")
        raw = log_weights.exp()
        if bounds.lower is None:
            weights = raw.clamp(max=bounds.upper)
        else:
            weights = torch.where((raw >= bounds.lower) & (raw <= bounds.upper), raw, 0.0)
        weights = torch.where(mask, weights, 0.0)
    return _ImportanceWeights(weights, raw, sequence_log_ratio, level, bounds)


def _needs_rollout_log_probs(config: PolicyLossConfig, what: str) -> ValueError:
    if config.rollout_is_cap is not None:
        key, value, off = "rollout_is_cap", config.rollout_is_cap, "set rollout_is_cap to null"
    else:
        key, value = f"rollout_correction.{what}", getattr(config.rollout_correction, what)
        off = f"set {what} to null"
    return ValueError(
        f"actor.policy_loss.{key}={value} needs the rollout's log-probs (batch key "
        f"'rollout_log_probs'): have the rollout return them, or {off}"
    )


def rollout_importance_weights(
    *,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The importance weights a policy loss multiplies its per-token loss by (detached; 0 off the
    mask), and their metrics over this micro-batch: ``actor/rollout_is_weight_mean`` (the weights'
    mean) and ``actor/rollout_is_clipfrac`` (the fraction of tokens whose weight is not their ratio:
    truncated, or masked to 0).

    ``config.correction`` (``actor.policy_loss.rollout_correction``, or the deprecated
    ``rollout_is_cap``) says which: ``None`` when ``rollout_is`` is off. Each weight depends on its own
    row only, so a loss computes them per micro-batch and gets the whole batch's.
    """
    correction = config.correction
    if correction.rollout_is is None:
        return None, {}
    if rollout_log_probs is None:
        raise _needs_rollout_log_probs(config, "rollout_is")
    weighted = _importance_weights(
        old_log_prob - rollout_log_probs, response_mask, correction.rollout_is, correction.is_bounds
    )
    metrics = {
        "actor/rollout_is_weight_mean": masked_mean(weighted.weights, response_mask),
        "actor/rollout_is_clipfrac": masked_mean((weighted.weights != weighted.raw).float(), response_mask),
    }
    return weighted.weights, metrics


# -- rejection -------------------------------------------------------------------------------------


def _divergence(name: str, log_ratio: torch.Tensor) -> torch.Tensor:
    """Per token: ``k1 = l`` (a log-ratio), ``k2 = l^2 / 2``, ``k3 = exp(l) - 1 - l``."""
    if name == "k1":
        return log_ratio
    if name == "k2":
        return 0.5 * log_ratio.square()
    return log_ratio.exp() - 1.0 - log_ratio


def _per_sequence(aggregate: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` summed, averaged or at their largest over each row's tokens (0 for a row without)."""
    if aggregate == "sum":
        return masked_sum(values, mask, dim=-1)
    if aggregate == "mean":
        return masked_mean(values, mask, dim=-1)
    largest = values.masked_fill(~mask, -math.inf).amax(dim=-1)
    return torch.where(mask.any(dim=-1), largest, 0.0)


def _rejection_keep(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, option: str, bounds: Bounds
) -> torch.Tensor:
    """Where criterion ``option`` (one of ``ROLLOUT_RS_OPTIONS``) keeps a token (a bool ``[B, R]``;
    ``True`` off the mask): its statistic within ``bounds``, a ``k1`` one as a ratio (``exp`` of it in
    ``[lower, upper]``), a ``k2`` or ``k3`` one at most ``upper``. A ``seq_*`` criterion keeps or
    rejects a whole sequence."""
    mask = response_mask.bool()
    level, _, divergence = option.rpartition("_")
    with torch.no_grad():
        statistic = _divergence(divergence, _clamped(torch.where(mask, log_ratio.detach(), 0.0)))
        if level != "token":
            statistic = _per_sequence(level.removeprefix("seq_"), statistic, mask).unsqueeze(-1)
        if divergence == "k1":  # in log space: no exp to overflow, and a lower bound of 0 is -inf
            lower = math.log(bounds.lower) if bounds.lower else -math.inf
            keep = (statistic >= lower) & (statistic <= math.log(bounds.upper))
        else:
            keep = statistic <= bounds.upper
        return keep.expand_as(mask) | ~mask


def _fractions(selected: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fraction of the set tokens that are ``selected``, and of the sequences with any (of those
    with a token set)."""
    selected = selected & mask
    return masked_mean(selected.float(), mask), masked_mean(selected.any(dim=-1).float(), mask.any(dim=-1))


def rollout_rejection_mask(
    *,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``response_mask`` without the tokens ``config.correction.rollout_rs`` rejects (every criterion
    must keep a token), and the metrics ``rollout_corr/rollout_rs_masked_fraction`` and
    ``rollout_corr/rollout_rs_seq_masked_fraction`` (the fraction of the set tokens rejected, and of
    the sequences that lost any), with ``rollout_rs_<criterion>_masked_fraction`` and
    ``..._seq_masked_fraction`` for each criterion. ``response_mask`` itself, and no metrics, when
    rejection is off."""
    correction = config.correction
    bounds = correction.rs_bounds
    if not bounds:
        return response_mask, {}
    if rollout_log_probs is None:
        raise _needs_rollout_log_probs(config, "rollout_rs")
    mask = response_mask.bool()
    log_ratio = old_log_prob - rollout_log_probs
    keep = torch.ones_like(mask)
    metrics: dict[str, torch.Tensor | float] = {}
    for option, option_bounds in bounds.items():
        kept = _rejection_keep(log_ratio, mask, option, option_bounds)
        keep &= kept
        (
            metrics[f"rollout_rs_{option}_masked_fraction"],
            metrics[f"rollout_rs_{option}_seq_masked_fraction"],
        ) = _fractions(~kept, mask)
    metrics["rollout_rs_masked_fraction"], metrics["rollout_rs_seq_masked_fraction"] = _fractions(~keep, mask)
    return torch.where(keep, response_mask, torch.zeros_like(response_mask)), _floats(metrics)


# -- the whole correction of a batch ---------------------------------------------------------------


@attrs.frozen
class RolloutCorrection:
    """What ``compute_rollout_correction`` found for a batch: the ``response_mask`` left after
    rejection, the importance ``weights`` on it (``None`` without ``rollout_is``) and the metrics."""

    response_mask: torch.Tensor
    weights: torch.Tensor | None
    metrics: dict[str, float]


def _weight_metrics(weighted: _ImportanceWeights, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's metrics of the weights (``rollout_is_*``) over the tokens ``mask`` sets."""
    weights, raw, bounds = weighted.weights, weighted.raw, weighted.bounds
    lower = bounds.lower if bounds.lower is not None else 1.0 / bounds.upper
    if weighted.level == "token":
        entries, high, low = mask, raw > bounds.upper, raw < lower
    else:  # one ratio per sequence, compared in log space and unclamped (as verl: its exact extremes)
        entries, log_ratio = mask.any(dim=-1), weighted.sequence_log_ratio[:, 0]
        high = log_ratio > math.log(bounds.upper)
        low = log_ratio < (math.log(lower) if lower > 0 else -math.inf)
    metrics = {
        "rollout_is_mean": masked_mean(weights, mask),
        "rollout_is_eff_sample_size": _normalised_ess(weights.clamp(0.0, bounds.upper), mask),
        "rollout_is_ratio_fraction_high": masked_mean(high.float(), entries),
        "rollout_is_ratio_fraction_low": masked_mean(low.float(), entries),
    }
    if weighted.masking:
        metrics["rollout_is_oob_ratio"] = masked_mean((weights == 0).float(), mask)
    return metrics


def compute_rollout_correction(
    *,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
) -> RolloutCorrection:
    """The rollout correction of a whole batch, as the trainer runs it once a step when the engine
    recomputed ``old_log_prob``: rejection (``rollout_rs``) first, then the importance weights
    (``rollout_is``) on the tokens kept, which the policy loss applies (``rollout_importance_weights``,
    the same numbers per micro-batch). Without ``rollout_log_probs``: nothing, or an error naming the
    key when a correction is on.

    Metrics (``rollout_corr/``): ``rollout_mismatch_metrics`` over the whole ``response_mask``; with
    rejection ``rollout_rejection_mask``'s; with weights verl's ``rollout_is_mean``,
    ``rollout_is_eff_sample_size`` (normalised, of the weights), ``rollout_is_ratio_fraction_high`` /
    ``_low`` (the fraction of ratios above ``upper`` / below ``lower``, or ``1/upper`` when
    truncating: of the tokens, or of the sequences for sequence weights) and, masking,
    ``rollout_is_oob_ratio`` (the fraction of tokens weighted 0). With any correction on, over the
    whole ``response_mask``: ``token_masked_fraction`` / ``seq_masked_fraction``, the tokens the
    correction takes out of the loss (rejected, or weighted 0) and the sequences that lost any, and
    ``token_truncated_fraction`` / ``seq_truncated_fraction``, the tokens whose weight was truncated
    and the sequences with any.
    """
    correction = config.correction
    if rollout_log_probs is None:  # nothing to measure; an error if something was to be corrected
        if correction.active:
            raise _needs_rollout_log_probs(config, "rollout_is" if correction.rollout_is else "rollout_rs")
        return RolloutCorrection(response_mask, None, {})
    metrics = rollout_mismatch_metrics(
        old_log_prob=old_log_prob, rollout_log_probs=rollout_log_probs, response_mask=response_mask
    )
    if not correction.active:
        return RolloutCorrection(response_mask, None, metrics)
    kept_mask, rejection_metrics = rollout_rejection_mask(
        old_log_prob=old_log_prob,
        rollout_log_probs=rollout_log_probs,
        response_mask=response_mask,
        config=config,
    )
    metrics |= rejection_metrics
    mask, kept = response_mask.bool(), kept_mask.bool()
    out_of_loss, truncated = mask & ~kept, torch.zeros_like(mask)
    weights = None
    if correction.rollout_is is not None:
        weighted = _importance_weights(
            old_log_prob - rollout_log_probs, kept, correction.rollout_is, correction.is_bounds
        )
        weights = weighted.weights
        if weighted.masking:
            out_of_loss |= kept & (weights == 0)
        else:
            truncated = kept & (weights != weighted.raw)
        metrics |= _floats(_weight_metrics(weighted, kept))
    combined: dict[str, torch.Tensor | float] = {}
    combined["token_masked_fraction"], combined["seq_masked_fraction"] = _fractions(out_of_loss, mask)
    combined["token_truncated_fraction"], combined["seq_truncated_fraction"] = _fractions(truncated, mask)
    return RolloutCorrection(kept_mask, weights, metrics | _floats(combined))
