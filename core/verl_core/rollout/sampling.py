"""Choosing the next token from logits: temperature, top-k, top-p, greedy; and its log-probability.

The log-probability reported for a sampled token is the one the training engine computes for it,
``log_softmax(logits / temperature)`` (untempered for greedy decoding): top-k and top-p only restrict
which tokens can be drawn. Sampling draws from a ``torch.Generator``, so the same seed gives the
same tokens.
"""

from __future__ import annotations

import torch

from verl_core.rollout.base import SamplingParams


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``scaled`` with every token outside the top ``top_k`` and outside the smallest set whose
    probability reaches ``top_p`` set to ``-inf`` (0 and 1 disable them). The most likely token is
    always kept."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # A token is dropped when the tokens before it already reach top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[B]`` drawn from ``logits`` ``[B, V]`` as ``sampling`` says, and their log-probs ``[B]``."""
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / sampling.temperature
    log_probs = scaled.log_softmax(dim=-1)
    filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
    tokens = torch.multinomial(filtered.softmax(dim=-1), 1, generator=generator)[:, 0]
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]
