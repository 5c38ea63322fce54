"""Log-probs and entropy from vocabulary-parallel logits: each TP rank holds its columns only.

With tensor parallelism the LM head's output is split by vocabulary columns over the TP ranks.
Gathering the whole vocabulary on every rank costs TP times the logits' memory and an all-gather;
instead each rank reduces its columns and three all-reduces over the TP group give the max, the
normaliser (and, for entropy, the expected logit) and the target's logit. The backward needs no
communication: with ``p`` the softmax, ``l`` the tempered logits and ``E = sum(p * l)``, the gradient
of the log-prob of token ``y`` is ``onehot(y) - p`` and that of the entropy ``-p * (l - E)``, both
per column, divided by the temperature. Every TP rank computes the same loss from the same outputs,
so each gets exactly its columns' share of the gradient (megatron-core's head all-reduces the rest).

Columns at or beyond ``vocab_size`` (rows padded so that TP divides the vocabulary) are no tokens:
they take no probability.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    vocab_start: int,
    vocab_size: int,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_probs [...]`` of ``labels`` and ``entropy [...]`` (``None`` unless ``compute_entropy``),
    in float32 or wider, from ``logits [..., V_local]``: this rank's columns ``vocab_start .. vocab_start + V_local``
    of a vocabulary of ``vocab_size`` tokens. A collective over ``group`` (the TP group)."""
    log_probs, entropy = _VocabParallel.apply(
        logits, labels, float(temperature), vocab_start, vocab_size, compute_entropy, group
    )
    return log_probs, (entropy if compute_entropy else None)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_start, vocab_size, compute_entropy, group):
        columns = vocab_start + torch.arange(logits.shape[-1], device=logits.device)
        real = columns < vocab_size
        scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        scaled = scaled.masked_fill(~real, -torch.inf)
        maximum = scaled.amax(dim=-1)
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = scaled - maximum.unsqueeze(-1)
        exp = shifted.exp()  # 0 on padding
        normaliser = exp.sum(dim=-1)
        local = labels - vocab_start
        here = (local >= 0) & (local < logits.shape[-1])
        target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target = torch.where(here, target, torch.zeros_like(target))
        finite = torch.where(real, shifted, torch.zeros_like(shifted))  # padding: -inf * 0 would be nan
        # One all-reduce for the sums: the normaliser, the target's logit, the (unnormalised) expected logit.
        sums = [normaliser, target]
        if compute_entropy:
            sums.append((exp * finite).sum(dim=-1))
        stacked = torch.stack(sums)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
        normaliser, target = stacked[0], stacked[1]
        log_normaliser = normaliser.log()
        log_probs = target - log_normaliser
        probs = exp / normaliser.unsqueeze(-1)
        entropy = expected = None
        if compute_entropy:
            expected = stacked[2] / normaliser  # E = sum(p * shifted)
            entropy = log_normaliser - expected
        ctx.save_for_backward(probs, finite if compute_entropy else None, expected, local, here)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        if entropy is None:
            entropy = torch.zeros_like(log_probs)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        probs, finite, expected, local, here = ctx.saved_tensors
        grad = -probs * grad_log_probs.unsqueeze(-1)
        onehot = torch.zeros_like(grad).scatter_(
            -1, local.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), here.to(grad.dtype).unsqueeze(-1)
        )
        grad = grad + onehot * grad_log_probs.unsqueeze(-1)
        if finite is not None and grad_entropy is not None:
            grad = grad - probs * (finite - expected.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return (grad / ctx.temperature).to(ctx.dtype), None, None, None, None, None, None
