"""The losses the conformance checks train with, written once for the engine and the reference.

The per-token formulas are shared; the normalisation is not: the engine-side loss functions divide
each micro-batch's token sum by the *global* token count the engine attached
(``verl_core.data.batch.get_global_counts``) and multiply by the DP size, while the reference sums
over the whole batch in one process and divides by its own count. If an engine splits, counts or
scales wrongly, the two disagree.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_core.data.batch import (
    ADVANTAGES,
    CANDIDATE_LOG_PROBS,
    ENTROPY,
    LOG_PROBS,
    RESPONSE_MASK,
    RETURNS,
    TEACHER_TOP_K_LOG_PROBS,
    VALUES,
    get_global_counts,
)

#: The sampling temperature of every log-prob and entropy computation in the kit (not 1, so that an
#: engine that ignores the batch's ``temperature`` fails).
TEMPERATURE = 0.7
#: Weight of the entropy bonus in the policy loss: entropy must carry gradients, not just be reported.
ENTROPY_COEF = 0.1


def policy_token_loss(
    log_probs: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """Per-token policy-gradient loss with an entropy bonus."""
    return -advantages * log_probs - ENTROPY_COEF * entropy


def value_token_loss(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """Per-token squared error of the critic."""
    return 0.5 * (values - returns) ** 2


def distillation_token_loss(
    candidate_log_probs: torch.Tensor, teacher_top_k_log_probs: torch.Tensor
) -> torch.Tensor:
    """Per-token cross-entropy from a teacher's top-k to the student: ``-sum_j p_teacher_j log p_j``
    over the teacher's ``k`` likeliest tokens (the student's log-probs at them, ``[..., k]``)."""
    return -(teacher_top_k_log_probs.exp() * candidate_log_probs).sum(dim=-1)


def policy_loss_fn(
    model_output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``LossFn`` for role ``lm``: token-mean of ``policy_token_loss`` over the global token count."""
    if ENTROPY not in model_output:
        raise KeyError(
            "the engine's model output has no 'entropy' although the batch sets compute_entropy=True: "
            "the forward pass must honour the batch's compute_entropy flag (with gradients)"
        )
    token_loss = policy_token_loss(model_output[LOG_PROBS], model_output[ENTROPY], micro_batch[ADVANTAGES])
    return _global_token_mean(token_loss, micro_batch)


def distillation_loss_fn(
    model_output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``LossFn`` for role ``lm`` on a teacher's top-k: token-mean of ``distillation_token_loss`` of the
    student's ``candidate_log_probs`` (at the batch's ``candidate_ids``, the teacher's top-k ids)."""
    if CANDIDATE_LOG_PROBS not in model_output:
        raise KeyError(
            "the engine's model output has no 'candidate_log_probs' although the batch has 'candidate_ids': "
            "the forward pass must return the log-probs at the batch's candidate_ids (with gradients)"
        )
    token_loss = distillation_token_loss(
        model_output[CANDIDATE_LOG_PROBS], micro_batch[TEACHER_TOP_K_LOG_PROBS]
    )
    return _global_token_mean(token_loss, micro_batch)


def value_loss_fn(
    model_output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``LossFn`` for role ``value``: token-mean of ``value_token_loss`` over the global token count."""
    return _global_token_mean(value_token_loss(model_output[VALUES], micro_batch[RETURNS]), micro_batch)


def _global_token_mean(
    token_loss: torch.Tensor, micro_batch: TensorDict
) -> tuple[torch.Tensor, dict[str, float]]:
    counts = get_global_counts(micro_batch)
    mask = micro_batch[RESPONSE_MASK].to(token_loss.dtype)
    # Scaling by the DP size undoes the gradient averaging of data parallelism.
    loss = (token_loss * mask).sum() / counts.num_tokens * counts.dp_size
    return loss, {"tokens": float(mask.sum())}
