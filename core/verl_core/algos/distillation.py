"""On-policy distillation's two signals on the student's own samples: a teacher's per-token reverse KL
as a reward, and GKD's generalised Jensen-Shannon divergence over the teacher's top-k tokens.

The student ``pi_s`` samples every response token ``y_t``; a teacher ``pi_t`` scores the same positions.

- **Reverse KL as a reward** (``reverse_kl_rewards``): ``r_t = -(log pi_s(y_t) - log pi_t(y_t))`` on each
  response token, a one-sample estimate of ``-KL(pi_s || pi_t)`` at position ``t`` (its expectation over
  ``y_t ~ pi_s``). Added to ``token_level_rewards`` it goes through any advantage estimator: the
  policy gradient then lowers the reverse KL, as tinker-cookbook's and verl's on-policy distillation do.
- **GKD** (``generalized_jsd``, Agarwal et al. 2024): at each position,
  ``JSD_beta(T, S) = beta KL(T || M) + (1 - beta) KL(S || M)`` with ``M = beta T + (1 - beta) S``;
  ``beta = 0`` is taken as the forward KL ``KL(T || S)`` and ``beta = 1`` as the reverse KL
  ``KL(S || T)``, the ends the divergence moves between (the convention of the GKD paper and of TRL's
  ``GKDTrainer``). ``T`` and ``S`` are the teacher's and the student's distributions over the teacher's
  ``k`` likeliest tokens **plus one outcome for the rest of the vocabulary** (each side's mass outside
  those ``k`` tokens): a ``k + 1``-point coarse-graining of both, so no mass is dropped or renormalised,
  the divergence is at most the full-vocabulary one (data processing) and equals it when ``k`` is the
  vocabulary. The student's tail is differentiable (``1 - sum`` of its ``k`` probabilities).

Both read log-probs at the rollout's temperature, the distribution the student sampled from.
"""

from __future__ import annotations

import math

import torch

from verl_core.algos.aggregation import agg_loss, masked_mean
from verl_core.data.batch import GlobalCounts

#: The smallest tail probability kept: below it the rest of the vocabulary counts as this much, so that
#: its logarithm (and gradient) stays finite when the top-k hold all the mass up to rounding.
MIN_TAIL_PROBABILITY = 1e-30


def reverse_kl_rewards(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``-(log_probs - teacher_log_probs)`` on response tokens, 0 elsewhere: the per-token reward of
    on-policy distillation (``[B, R]``; ``log_probs`` are the student's, of its sampled tokens)."""
    return (teacher_log_probs - log_probs) * response_mask


def with_tail(top_log_probs: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` log-probs of ``k`` tokens as ``[..., k + 1]``: one more outcome, the rest of the
    vocabulary, whose probability is what the ``k`` leave (at least ``MIN_TAIL_PROBABILITY``); float16
    and bfloat16 upcast to float32."""
    if top_log_probs.dtype in (torch.float16, torch.bfloat16):
        top_log_probs = top_log_probs.float()
    covered = torch.logsumexp(top_log_probs, dim=-1, keepdim=True)
    tail = (-torch.expm1(covered)).clamp_min(MIN_TAIL_PROBABILITY)
    return torch.cat([top_log_probs, tail.log()], dim=-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(P || Q)`` over the last dimension, from log-probs."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def generalized_jsd(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, beta: float
) -> torch.Tensor:
    """GKD's ``JSD_beta(T, S)`` per position (module docstring), from ``[..., k]`` log-probs of the same
    ``k`` tokens (the teacher's top-k: its log-probs, and the student's at those ids), the rest of the
    vocabulary one more outcome on each side. ``beta`` in ``[0, 1]``; returns ``[...]``."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: must be within [0, 1] (0: forward KL, 1: reverse KL)")
    student, teacher = with_tail(student_log_probs), with_tail(teacher_log_probs)
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


def gkd_loss(
    *,
    candidate_log_probs: torch.Tensor,
    teacher_top_k_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    loss_agg_mode: str,
    counts: GlobalCounts,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``generalized_jsd`` of the student (``candidate_log_probs``: its log-probs at the teacher's top-k
    ids, ``[B, R, k]``) against the teacher (``[B, R, k]``) on response tokens, aggregated like the
    policy loss (``loss_agg_mode``, the step's global counts); metric ``distillation/jsd`` (the
    micro-batch's token mean)."""
    divergence = generalized_jsd(candidate_log_probs, teacher_top_k_log_probs, beta)
    loss = agg_loss(divergence, response_mask, loss_agg_mode, counts)
    return loss, {"distillation/jsd": masked_mean(divergence.detach(), response_mask).item()}
