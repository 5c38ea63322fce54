"""Time of the algorithm layer on a realistic batch, side by side with the naive alternative.

Advantage estimators: each vectorised group estimator (and GAE's batched time scan) against a naive
implementation that loops in Python over samples and groups (GAE: over sequences and tokens), the way
such code is often first written. Both run on the same batch and their results are checked to agree.

    python benchmarks/algos.py                       # 4096 x 1024, groups of 8, one thread
    python benchmarks/algos.py --batch 512 --length 256 --repeats 1
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from verl_core.algos import advantage
from verl_core.config.algorithm import AlgorithmConfig

# -- naive alternatives: Python loops over samples and groups ------------------------------------


def _naive_groups(index: list[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = defaultdict(list)
    for i, label in enumerate(index):
        members[label].append(i)
    return members


def naive_grpo(rewards, mask, index, config):
    scores = rewards.sum(-1)
    out = torch.empty_like(scores)
    for members in _naive_groups(index).values():
        group = scores[members]
        mean, std = (group.mean(), group.std()) if len(members) > 1 else (0.0, 1.0)
        for i in members:
            out[i] = (scores[i] - mean) / (std + advantage.STD_EPS)
    return out.unsqueeze(-1) * mask


def naive_rloo(rewards, mask, index, config):
    scores = rewards.sum(-1)
    out = scores.clone()
    for members in _naive_groups(index).values():
        n = len(members)
        if n > 1:
            total = scores[members].sum()
            for i in members:
                out[i] = scores[i] - (total - scores[i]) / (n - 1)
    return out.unsqueeze(-1) * mask


def naive_opo(rewards, mask, index, config):
    scores, lengths = rewards.sum(-1), mask.sum(-1)
    out = scores.clone()
    for members in _naive_groups(index).values():
        if len(members) > 1:
            baseline = (lengths[members] * scores[members]).sum() / lengths[members].sum()
            for i in members:
                out[i] = scores[i] - baseline
    return out.unsqueeze(-1) * mask


def _naive_centred(scores, index):
    out = scores.clone()
    for members in _naive_groups(index).values():
        if len(members) > 1:
            mean = scores[members].mean()
            for i in members:
                out[i] = scores[i] - mean
    return out


def naive_gpg(rewards, mask, index, config):
    scores = rewards.sum(-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    return alpha * _naive_centred(scores, index).unsqueeze(-1) * mask


def naive_reinforce_plus_plus_baseline(rewards, mask, index, config):
    centred = _naive_centred(rewards.sum(-1), index).unsqueeze(-1) * mask
    return advantage.masked_whiten(centred, mask)


def naive_grpo_passk(rewards, mask, index, config):
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for members in _naive_groups(index).values():
        top2, top2_positions = torch.topk(scores[members], 2)
        out[members[int(top2_positions[0])]] = (top2[0] - top2[1]) / (
            scores[members].std() + advantage.STD_EPS
        )
    return out.unsqueeze(-1) * mask


def naive_gae(rewards, mask, values, config):
    rows = zip(rewards.tolist(), mask.tolist(), values.tolist(), strict=True)
    advantages = [[0.0] * len(row) for row in mask.tolist()]
    for i, (reward_row, mask_row, value_row) in enumerate(rows):
        next_value = next_advantage = 0.0
        for t in reversed(range(len(mask_row))):
            if mask_row[t]:
                delta = reward_row[t] + config.gamma * next_value - value_row[t]
                next_advantage = delta + config.gamma * config.lam * next_advantage
                next_value = value_row[t]
                advantages[i][t] = next_advantage
    return advantage.masked_whiten(torch.tensor(advantages, dtype=rewards.dtype), mask)


# -- timing --------------------------------------------------------------------------------------


def best_time(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    """Best wall time over ``repeats`` runs (the least disturbed by other processes), and the result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def make_batch(batch: int, length: int, group_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length) < lengths.unsqueeze(-1)).float()
    rewards = torch.zeros(batch, length)
    # An outcome reward of 0 or 1 on each response's last token, as a verifier gives.
    rewards[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=generator).float()
    values = torch.randn(batch, length, generator=generator)
    index = torch.randperm(batch, generator=generator).div(group_size, rounding_mode="floor").tolist()
    return rewards, mask, index, values


def bench_advantages(args: argparse.Namespace) -> None:
    rewards, mask, index, values = make_batch(args.batch, args.length, args.group_size)
    config = AlgorithmConfig(gamma=0.99, lam=0.95)
    cases = [
        ("grpo", advantage.compute_grpo_outcome_advantage, naive_grpo),
        ("rloo", advantage.compute_rloo_outcome_advantage, naive_rloo),
        ("opo", advantage.compute_opo_outcome_advantage, naive_opo),
        ("gpg", advantage.compute_gpg_outcome_advantage, naive_gpg),
        ("reinforce_plus_plus_baseline", advantage.compute_reinforce_plus_plus_baseline_outcome_advantage,
         naive_reinforce_plus_plus_baseline),
        ("grpo_passk", advantage.compute_grpo_passk_outcome_advantage, naive_grpo_passk),
    ]  # fmt: skip
    print(
        f"advantage estimators: batch {args.batch} x {args.length}, groups of {args.group_size}, "
        f"{torch.get_num_threads()} thread(s), best of {args.repeats}"
    )
    print(f"{'estimator':<30} {'vectorised ms':>14} {'naive loop ms':>14} {'naive / vectorised':>19}")
    for name, fast, naive in cases:
        fast_time, fast_result = best_time(
            lambda fast=fast: fast(
                token_level_rewards=rewards, response_mask=mask, index=index, config=config
            )[0],
            args.repeats,
        )
        naive_time, naive_result = best_time(
            lambda naive=naive: naive(rewards, mask, index, config), args.repeats
        )
        torch.testing.assert_close(fast_result, naive_result, atol=1e-4, rtol=1e-4, msg=name)
        print(
            f"{name:<30} {fast_time * 1e3:>14.1f} {naive_time * 1e3:>14.1f} {naive_time / fast_time:>18.1f}x"
        )

    fast_time, fast_result = best_time(
        lambda: advantage.compute_gae_advantage_return(
            token_level_rewards=rewards, response_mask=mask, values=values, config=config
        )[0],
        args.repeats,
    )
    naive_time, naive_result = best_time(lambda: naive_gae(rewards, mask, values, config), 1)
    torch.testing.assert_close(fast_result, naive_result, atol=1e-4, rtol=1e-4, msg="gae")
    print(f"{'gae (time scan vs token loop)':<30} {fast_time * 1e3:>14.1f} {naive_time * 1e3:>14.1f} "
          f"{naive_time / fast_time:>18.1f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_advantages(args)


if __name__ == "__main__":
    main()
