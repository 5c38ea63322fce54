"""Loss aggregation: reduce a ``[batch, response_len]`` loss matrix to the scalar a micro-batch returns.

Every mode divides by the **global** counts of the step (``GlobalCounts``: tokens and sequences over
all micro-batches on all data-parallel ranks) and multiplies by the DP size, because DDP and FSDP
average gradients over ranks. Then, whatever the split into micro-batches and ranks,

* the sum of the returned losses over micro-batches and ranks is ``dp_size`` times the full-batch loss,
* the gradient after accumulation over micro-batches and averaging over ranks is the full-batch one.

With ``n`` the global token count, ``S`` the global sequence count, ``T`` the padded response length
(``counts.max_response_len``) and ``m`` the mask, the full-batch losses (``dp_size = 1``) are:

==========================  ==================================================  =====================
mode                        loss                                                used by
==========================  ==================================================  =====================
``token-mean``              sum_{i,t} m l / n                                   PPO, DAPO
``token-sum``               sum_{i,t} m l                                       (sum-reduced losses)
``seq-mean-token-sum``      (1/S) sum_i sum_t m l                               sequence-level sums
``seq-mean-token-mean``     (1/S) sum_i (sum_t m l / sum_t m)                   GRPO (original), GSPO
``seq-mean-token-sum-norm`` (1/S) sum_i sum_t m l / T                           Dr. GRPO
==========================  ==================================================  =====================

Sequences are those ``counts.num_seqs`` counts (``compute_global_counts`` counts every row, so an
empty response adds zero to the numerator and one to ``S``).
"""

from __future__ import annotations

import torch

from verl_core.config.algorithm import LOSS_AGG_MODES
from verl_core.data.batch import GlobalCounts

# The names' one home is the config's ``LossAggMode``; in its order.
TOKEN_MEAN, TOKEN_SUM, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM_NORM = LOSS_AGG_MODES


def check_loss_agg_mode(loss_agg_mode: str, key: str = "loss_agg_mode") -> None:
    """Raise ``ValueError`` naming ``key`` and the valid modes unless ``loss_agg_mode`` is one of them."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"{key}={loss_agg_mode!r} is not a loss aggregation mode; use one of {', '.join(LOSS_AGG_MODES)}"
        )


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set. Masked-out entries never leak, even if inf or NaN."""
    selected = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (over ``dim``, or everything); 0 where nothing is set.

    A local statistic (this micro-batch only): use it for metrics, and ``agg_loss`` for losses.
    """
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def agg_loss(
    loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, counts: GlobalCounts
) -> torch.Tensor:
    """Aggregate a per-token loss ``[batch, response_len]`` into this micro-batch's share of the loss.

    ``loss_mask`` selects the tokens that count; ``counts`` are the step's global counts. The result
    summed over every micro-batch on every rank is ``counts.dp_size`` times the full-batch loss (see
    the module docstring for each mode's formula).
    """
    check_loss_agg_mode(loss_agg_mode)
    mask = loss_mask.bool()
    dp_size = counts.dp_size
    if loss_agg_mode == TOKEN_MEAN:
        return masked_sum(loss_mat, mask) * (dp_size / max(counts.num_tokens, 1))
    if loss_agg_mode == TOKEN_SUM:
        return masked_sum(loss_mat, mask) * dp_size

    seq_token_sums = masked_sum(loss_mat, mask, dim=-1)
    if loss_agg_mode == SEQ_MEAN_TOKEN_MEAN:
        seq_lengths = mask.sum(-1).clamp(min=1).to(loss_mat.dtype)
        seq_losses = seq_token_sums / seq_lengths
    elif loss_agg_mode == SEQ_MEAN_TOKEN_SUM_NORM:
        # Dr. GRPO divides by a constant horizon; the local padded length would change with the split.
        if counts.max_response_len <= 0:
            raise ValueError(
                f"loss_agg_mode={SEQ_MEAN_TOKEN_SUM_NORM!r} divides by GlobalCounts.max_response_len, "
                f"which is {counts.max_response_len}: build the counts with compute_global_counts or "
                "pass max_response_len (the padded response length of the batch)"
            )
        seq_losses = seq_token_sums / counts.max_response_len
    else:
        seq_losses = seq_token_sums
    return seq_losses.sum() * (dp_size / max(counts.num_seqs, 1))
