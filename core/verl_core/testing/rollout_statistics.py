"""The rollout kit's two statistical tests, as plain functions of the reference's distributions and
the rollout's tokens. Both are deterministic for a given rollout (the kit's seeds are fixed); what
is random is only whether a correct rollout's fixed draws happen to look wrong, and each test states
how likely that is.

- ``log_prob_z``: were tokens drawn from the distributions they are scored under? Under
  ``softmax(logits / T)`` a sampled token's log-probability has mean ``-H`` (minus the entropy) and
  variance ``V``; summed over the tokens, ``z = sum(log p + H) / sqrt(sum V)`` is about standard
  normal. Tokens from a hotter distribution are less likely than that (``z`` negative), tokens
  from a filtered or colder one more likely (``z`` positive). For independent draws from known
  distributions (one token per prompt), ``z_false_failure`` bounds the chance that a correct
  rollout's ``|z|`` exceeds a limit, exactly (a Chernoff bound: the moment generating function of
  ``log p`` under ``p`` is ``sum p^(1 + s)``), not by the normal approximation.
- ``repeated_draws``: are the ``n`` draws of one prompt independent? Per group of ``m`` draws from
  ``p``, the chance that two of them coincide is ``1 - m! e_m(p)`` (``e_m``: the elementary
  symmetric polynomial of the probabilities, the chance of ``m`` distinct tokens in a given order).
  The number of groups with a repeat is then a sum of independent Bernoulli variables, whose exact
  upper tail is the test's p-value: draws shared within a group make every group repeat.
"""

from __future__ import annotations

import math

import attrs
import torch


@attrs.frozen
class ZTest:
    """``log_prob_z``'s result: ``z``, the number of tokens, their mean log-probability and the mean
    the distributions predict for it (minus their mean entropy)."""

    z: float
    tokens: int
    mean_log_prob: float
    expected_mean: float


def log_prob_z(log_probs: torch.Tensor, sampled: torch.Tensor) -> ZTest:
    """``z`` of the tokens ``sampled`` ``[N]``, each drawn (if all is well) from its row of
    ``log_probs`` ``[N, V]`` (normalised log-probabilities)."""
    log_probs = log_probs.double()
    p = log_probs.exp()
    # 0 * -inf is nan: a token a filter removed contributes nothing to the entropy.
    plogp = torch.where(p > 0, p * log_probs, torch.zeros_like(p))
    entropy = -plogp.sum(dim=-1)
    spread = torch.where(p > 0, p * log_probs.square(), torch.zeros_like(p)).sum(dim=-1) - entropy.square()
    drawn = log_probs.gather(-1, sampled[:, None].long())[:, 0]
    tokens = len(sampled)
    return ZTest(
        z=float((drawn + entropy).sum()) / math.sqrt(float(spread.sum())),
        tokens=tokens,
        mean_log_prob=float(drawn.mean()),
        expected_mean=float(-entropy.mean()),
    )


def z_false_failure(log_probs: torch.Tensor, limit: float) -> float:
    """An upper bound on the chance that ``|z|`` exceeds ``limit`` when one token is drawn from each row
    of ``log_probs`` ``[N, V]``, independently: Chernoff's ``min over s of exp(-s t) E[exp(s (S - E S))]``
    for each tail, ``t = limit * sqrt(sum V)``, minimised over a grid of ``s``."""
    log_probs = log_probs.double()
    p = log_probs.exp()
    mean = torch.where(p > 0, p * log_probs, torch.zeros_like(p)).sum(dim=-1)
    variance = torch.where(p > 0, p * log_probs.square(), torch.zeros_like(p)).sum(dim=-1) - mean.square()
    t = limit * math.sqrt(float(variance.sum()))
    bound = 0.0
    for sign in (1.0, -1.0):
        exponents = []
        for step in range(1, 400):
            s = sign * step / 100
            # log E[exp(s X)] = log sum_v p_v^(1 + s), X = log p of the drawn token.
            log_mgf = torch.logsumexp(torch.where(p > 0, log_probs * (1 + s), -math.inf), dim=-1) - s * mean
            exponents.append(float(log_mgf.sum()) - abs(s) * t)
        bound += math.exp(min(exponents))
    return min(bound, 1.0)


@attrs.frozen
class RepeatTest:
    """``repeated_draws``' result: the groups whose draws repeat a token, how many independent draws
    would repeat on average, and the chance that independent draws repeat in as many groups or more."""

    repeated: int
    groups: int
    expected: float
    p_value: float


def repeated_draws(probabilities: torch.Tensor, draws: list[list[int]]) -> RepeatTest:
    """Test ``draws`` (per group, the tokens drawn from that group's row of ``probabilities``
    ``[G, V]``) for independence: the exact chance, under independent draws, of at least as many
    groups with a repeated token as observed."""
    sizes = [len(group) for group in draws]
    # e_k of each group's probabilities, k = 0..max size, one vocabulary entry at a time.
    symmetric = torch.zeros(len(draws), max(sizes, default=0) + 1, dtype=torch.float64)
    symmetric[:, 0] = 1.0
    for probability in probabilities.double().T:
        symmetric[:, 1:] = symmetric[:, 1:] + symmetric[:, :-1] * probability[:, None]
    repeat_chances = [
        min(max(1.0 - math.factorial(size) * float(symmetric[group, size]), 0.0), 1.0)
        for group, size in enumerate(sizes)
    ]
    repeated = sum(len(set(group)) < len(group) for group in draws)
    # The number of groups that repeat: a sum of independent Bernoulli variables (Poisson binomial).
    counts = torch.zeros(len(draws) + 1, dtype=torch.float64)
    counts[0] = 1.0
    for chance in repeat_chances:
        counts[1:] = counts[1:] * (1 - chance) + counts[:-1] * chance
        counts[0] = counts[0] * (1 - chance)
    return RepeatTest(
        repeated=repeated,
        groups=len(draws),
        expected=sum(repeat_chances),
        p_value=float(counts[repeated:].sum()),
    )
