"""Advantage estimators: from token-level rewards (and values, group ids) to advantages and returns.

Every estimator has the same keyword-only signature, so that the trainer calls any of them, built-in
or plugin-provided, by name (``algorithm.adv_estimator``) in the same way::

    fn(*, token_level_rewards, response_mask, index=None, values=None, config: AlgorithmConfig,
       **optional_inputs) -> (advantages, returns)

All tensors are padded ``[batch, response_len]``; ``response_mask`` is 1 on tokens the policy produced
(0 on padding and on observation tokens of multi-turn rollouts). ``index`` holds each sample's group
id (the batch's ``uid``): a sequence of hashables or an integer tensor. ``values`` are the critic's
values. Optional inputs an estimator does not use are ignored (``reward_baselines`` is ReMax's).
Both outputs are zero where ``response_mask`` is 0.

Outcome estimators score a sample by the sum of its token-level rewards. Group statistics are
computed with ``index_add`` over dense group ids (no Python loop over samples or groups); a group of
one sample has baseline 0 (and std 1 for GRPO), as in verl. GAE and REINFORCE++ scan backwards over
time, vectorised over the batch, skipping positions where ``response_mask`` is 0: an observation span
neither discounts nor cuts the return flowing back to the earlier turn.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch

from verl_core.config.algorithm import AlgorithmConfig

#: Group ids: one hashable per sample (``uid`` strings), or an integer tensor ``[batch]``.
GroupIds = torch.Tensor | Sequence[Hashable]

#: Added to the group std before dividing (GRPO, pass@k), as in verl.
STD_EPS = 1e-6
#: Added to the variance before whitening.
WHITEN_EPS = 1e-8


# -- helpers -------------------------------------------------------------------------------------


@attrs.frozen
class Groups:
    """Dense group ids ``0..num_groups-1`` of a batch, and per-group reductions by ``index_add``."""

    ids: torch.Tensor  #: ``[batch]`` int64: the group of each sample
    sizes: torch.Tensor  #: ``[num_groups]`` int64

    @classmethod
    def from_index(cls, index: GroupIds | None, batch_size: int, device: torch.device) -> Groups:
        """Factorise ``index`` (hashables or an int tensor) into dense ids on ``device``."""
        if index is None:
            raise ValueError(
                "this advantage estimator needs group ids: pass index= (the batch's 'uid', one id per "
                "sample, shared by the responses to the same prompt; set rollout.n > 1 to sample groups)"
            )
        if isinstance(index, torch.Tensor):
            if index.dim() != 1 or index.dtype.is_floating_point or index.dtype.is_complex:
                raise ValueError(
                    f"index: expected a 1-d integer tensor of group ids, got {index.dtype} of shape "
                    f"{tuple(index.shape)}"
                )
            _, ids = torch.unique(index, return_inverse=True)
            ids = ids.to(device=device, dtype=torch.int64)
        else:
            # Hash each label once; all arithmetic below is vectorised over the dense ids.
            dense = {label: i for i, label in enumerate(dict.fromkeys(index))}
            ids = torch.tensor([dense[label] for label in index], dtype=torch.int64, device=device)
        if ids.numel() != batch_size:
            raise ValueError(
                f"index has {ids.numel()} group ids but the batch has {batch_size} samples: pass one id per "
                "sample (the batch's 'uid')"
            )
        num_groups = int(ids.max().item()) + 1 if batch_size else 0
        sizes = torch.bincount(ids, minlength=num_groups)
        return cls(ids=ids, sizes=sizes)

    @property
    def num_groups(self) -> int:
        return self.sizes.numel()

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group sums ``[num_groups]`` of a per-sample tensor ``[batch]``."""
        return x.new_zeros(self.num_groups).index_add_(0, self.ids, x)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group means; groups of one sample get 0 (no baseline can be formed from the others)."""
        return torch.where(self.sizes > 1, self.sum(x) / self.sizes.clamp(min=1), 0.0)

    def std(self, x: torch.Tensor) -> torch.Tensor:
        """Per-group unbiased std (two-pass); groups of one sample get 1 (they are not rescaled)."""
        deviation = x - (self.sum(x) / self.sizes.clamp(min=1))[self.ids]
        var = self.sum(deviation.square()) / (self.sizes - 1).clamp(min=1)
        return torch.where(self.sizes > 1, var.sqrt(), 1.0)


def zero_where_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, else 0 (NaN-safe, unlike ``x * mask``)."""
    # A 0-dim zero of x's dtype: a Python 0.0 takes a slower type-promoting path in torch.where.
    return torch.where(mask, x, x.new_zeros(()))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whiten ``x`` over the positions where ``mask`` is set (mean 0, unbiased variance 1).

    Values at masked-out positions neither enter the statistics nor the result (which is 0 there);
    with fewer than two tokens every whitened value is 0.
    """
    mask = mask.bool()
    selected = x[mask]
    if selected.numel() < 2:
        return torch.zeros_like(x)
    var, mean = torch.var_mean(selected, correction=1)
    return zero_where_masked((x - mean) * torch.rsqrt(var + WHITEN_EPS), mask)


def _outcome_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    """Each sample's score: the sum of its token-level rewards, in at least float32."""
    dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
    return token_level_rewards.sum(dim=-1, dtype=dtype)


def _broadcast_to_tokens(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return zero_where_masked(per_sample.unsqueeze(-1), response_mask.bool())


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{next valid t}`` scanned backwards, skipping masked positions."""
    # Scan time-major: each step then reads and writes one contiguous row instead of a strided column.
    rewards_by_time, mask_by_time = rewards.T.contiguous(), mask.T.contiguous()
    running = rewards.new_zeros(rewards.shape[0])
    returns_by_time = torch.empty_like(rewards_by_time)
    for t in reversed(range(rewards_by_time.shape[0])):
        running = torch.where(mask_by_time[t], rewards_by_time[t] + gamma * running, running)
        returns_by_time[t] = running
    return returns_by_time.T.contiguous()


# -- estimators ----------------------------------------------------------------------------------


def compute_gae_advantage_return(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), with whitened advantages.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where *next*
    is the next position with ``response_mask`` 1 (observation spans are skipped, not discounted) and
    the value after the last token is 0. Returns are ``A + V`` before whitening. Values and rewards at
    masked positions never enter the result.
    """
    if values is None:
        raise ValueError("adv_estimator 'gae' needs the critic's values: pass values= (the batch's 'values')")
    mask = response_mask.bool()
    dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
    rewards = zero_where_masked(token_level_rewards.to(dtype), mask)
    values = zero_where_masked(values.to(dtype), mask)
    gamma, lam = config.gamma, config.lam

    # Scan time-major: each step then reads and writes contiguous rows instead of strided columns.
    rewards_by_time, values_by_time, mask_by_time = (x.T.contiguous() for x in (rewards, values, mask))
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    advantages_by_time = torch.empty_like(rewards_by_time)
    for t in reversed(range(rewards_by_time.shape[0])):
        valid = mask_by_time[t]
        delta = rewards_by_time[t] + gamma * next_value - values_by_time[t]
        next_advantage = torch.where(valid, delta + gamma * lam * next_advantage, next_advantage)
        next_value = torch.where(valid, values_by_time[t], next_value)
        advantages_by_time[t] = next_advantage
    advantages = advantages_by_time.T.contiguous()
    returns = zero_where_masked(advantages + values, mask)
    return masked_whiten(advantages, mask), returns


def compute_grpo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): ``A_i = (s_i - mean_g) / (std_g + eps)`` for every token of sample i.

    With ``norm_adv_by_std_in_grpo=False``, ``A_i = s_i - mean_g`` (Dr. GRPO, Liu et al. 2025).
    ``std_g`` is the unbiased std of the group's scores; a singleton group has mean 0 and std 1.
    """
    scores = _outcome_scores(token_level_rewards)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    advantages = scores - groups.mean(scores)[groups.ids]
    if config.norm_adv_by_std_in_grpo:
        advantages = advantages / (groups.std(scores)[groups.ids] + STD_EPS)
    advantages = _broadcast_to_tokens(advantages, response_mask)
    return advantages, advantages


def compute_grpo_passk_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO pass@k (Tang et al. 2025, arXiv:2503.19595): only each group's best sample is credited.

    The best sample gets ``s_max - s_second`` (divided by ``std_g + eps`` when
    ``norm_adv_by_std_in_grpo``); every other sample gets 0. Groups need at least two samples.
    """
    scores = _outcome_scores(token_level_rewards)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    if bool((groups.sizes < 2).any()):
        raise ValueError(
            "adv_estimator 'grpo_passk' needs at least 2 samples per group (index), got a group of "
            f"{int(groups.sizes.min())}: sample several responses per prompt (rollout.n >= 2)"
        )
    # Sort by score (descending), then stably by group: each group's run starts with its top two.
    by_score = torch.argsort(scores, descending=True, stable=True)
    order = by_score[torch.argsort(groups.ids[by_score], stable=True)]
    starts = torch.cumsum(groups.sizes, 0) - groups.sizes
    best, second = order[starts], order[starts + 1]
    margin = scores[best] - scores[second]
    if config.norm_adv_by_std_in_grpo:
        margin = margin / (groups.std(scores) + STD_EPS)
    advantages = torch.zeros_like(scores).index_put_((best,), margin)
    advantages = _broadcast_to_tokens(advantages, response_mask)
    return advantages, advantages


def compute_rloo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): ``A_i = s_i - mean of the other samples of i's group``.

    A singleton group has no other samples; its advantage is its score.
    """
    scores = _outcome_scores(token_level_rewards)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    sizes = groups.sizes[groups.ids]
    leave_one_out_mean = (groups.sum(scores)[groups.ids] - scores) / (sizes - 1).clamp(min=1)
    advantages = torch.where(sizes > 1, scores - leave_one_out_mean, scores)
    advantages = _broadcast_to_tokens(advantages, response_mask)
    return advantages, advantages


def compute_reinforce_plus_plus_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns ``G_t = r_t + gamma * G_next``, whitened over the batch.

    Returns are ``G``; advantages are ``G`` whitened over all valid tokens of the batch.
    """
    mask = response_mask.bool()
    dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
    rewards = token_level_rewards.to(dtype)
    returns = _discounted_returns(rewards, mask, config.gamma)
    returns = zero_where_masked(returns, mask)
    return masked_whiten(returns, mask), returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with group baseline (Hu 2025): ``s_i - mean_g`` on every token, whitened over the batch."""
    scores = _outcome_scores(token_level_rewards)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    centred = _broadcast_to_tokens(scores - groups.mean(scores)[groups.ids], response_mask)
    advantages = masked_whiten(centred, response_mask)
    return advantages, advantages


def compute_remax_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgorithmConfig,
    reward_baselines: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2024): ``A_t = G_t - b`` with ``G_t`` the undiscounted reward-to-go.

    ``reward_baselines`` ``[batch]`` is the reward of the greedy response to the same prompt.
    """
    if reward_baselines is None:
        raise ValueError(
            "adv_estimator 'remax' needs reward_baselines= (the reward of a greedy response to each "
            "prompt, batch key 'reward_baselines')"
        )
    mask = response_mask.bool()
    dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
    rewards = zero_where_masked(token_level_rewards.to(dtype), mask)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    advantages = returns - _broadcast_to_tokens(reward_baselines.to(dtype), mask)
    return zero_where_masked(advantages, mask), zero_where_masked(returns, mask)


def compute_opo_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): ``A_i = s_i - sum_g(len_j * s_j) / sum_g(len_j)``, a length-weighted baseline.

    ``len_j`` is the number of response tokens of sample j; a singleton group (or a group of empty
    responses) has baseline 0.
    """
    scores = _outcome_scores(token_level_rewards)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)
    group_lengths = groups.sum(lengths)
    baseline = groups.sum(lengths * scores) / group_lengths.clamp(min=1)
    baseline = torch.where((groups.sizes > 1) & (group_lengths > 0), baseline, 0.0)
    advantages = _broadcast_to_tokens(scores - baseline[groups.ids], response_mask)
    return advantages, advantages


def compute_gpg_outcome_advantage(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIds | None = None,
    config: AlgorithmConfig,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): ``A_i = alpha * (s_i - mean_g)`` with ``alpha = B / #{i : s_i != 0}``.

    ``alpha`` rescales the batch's gradient to the samples that carry reward (verl's form of the
    paper's ``B / (B - M)``); a singleton group has mean 0.
    """
    scores = _outcome_scores(token_level_rewards)
    groups = Groups.from_index(index, scores.shape[0], scores.device)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    advantages = _broadcast_to_tokens(alpha * (scores - groups.mean(scores)[groups.ids]), response_mask)
    return advantages, advantages
