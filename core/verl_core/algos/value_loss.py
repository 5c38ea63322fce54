"""The critic's clipped value loss (PPO, Schulman et al. 2017; value clipping as in OpenAI's baselines).

With ``V`` the critic's new predictions, ``V_old`` the values from before the update (the batch's
``values``), ``R`` the returns and ``c`` = ``critic.loss.cliprange_value``::

    V_clip = clamp(V, V_old - c, V_old + c)
    l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

and the loss is ``l`` aggregated over ``response_mask`` with ``critic.loss.loss_agg_mode`` (see
``verl_core.algos.aggregation``), so that it is normalised by the step's global counts.
"""

from __future__ import annotations

import torch

from verl_core.algos.aggregation import agg_loss, check_loss_agg_mode, masked_mean
from verl_core.config.algorithm import CriticLossConfig
from verl_core.data.batch import GlobalCounts


def clipped_value_loss_matrix(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token clipped value loss ``[batch, response_len]`` (0 where masked) and its metrics.

    Metrics (local to this micro-batch): ``critic/vf_clipfrac``, the fraction of valid tokens whose
    clipped term is the larger one (where clipping takes effect), and ``critic/vpred_mean``.
    """
    mask = response_mask.bool()
    vpreds_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpreds_clipped - returns).square()
    loss_mat = torch.where(mask, 0.5 * torch.maximum(unclipped, clipped), 0.0)
    metrics = {
        "critic/vf_clipfrac": float(masked_mean((clipped > unclipped).to(vpreds.dtype), mask)),
        "critic/vpred_mean": float(masked_mean(vpreds.detach(), mask)),
    }
    return loss_mat, metrics


def compute_value_loss(
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    config: CriticLossConfig,
    counts: GlobalCounts,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the clipped value loss, normalised by the step's global ``counts``.

    Summed over micro-batches and ranks it gives ``counts.dp_size`` times the full-batch loss (see
    ``agg_loss``). Metrics as in ``clipped_value_loss_matrix``, plus ``critic/vf_loss`` (the returned
    loss).
    """
    check_loss_agg_mode(config.loss_agg_mode, key="critic.loss.loss_agg_mode")
    loss_mat, metrics = clipped_value_loss_matrix(
        vpreds=vpreds,
        values=values,
        returns=returns,
        response_mask=response_mask,
        cliprange_value=config.cliprange_value,
    )
    loss = agg_loss(loss_mat, response_mask, config.loss_agg_mode, counts)
    metrics["critic/vf_loss"] = float(loss.detach())
    return loss, metrics
