"""Per-token log-probabilities and entropy from logits, with sampling temperature.

Both work on the tempered distribution ``softmax(logits / temperature)``, the one a rollout samples
from. Log-probs need only ``logsumexp`` and a gather (no softmax copy of the vocabulary); entropy needs
one probability tensor. Low-precision logits are upcast to float32 first.

``chunked_log_probs_and_entropy`` computes the same from the final hidden states and the LM head's
weight, a chunk of tokens at a time, so that the ``[tokens, vocabulary]`` logits (and their float32,
tempered and probability copies) exist for one chunk at a time only: with a 150k vocabulary they are
what runs out of memory first. Its backward (a custom ``torch.autograd.Function``, the forward having
kept only the inputs and each token's ``logsumexp`` and entropy) recomputes one chunk's logits at a
time and writes their gradient in closed form, rather than autograd replaying and differentiating
every elementwise op of the chunk.

``token_log_probs`` and ``chunked_token_log_probs`` compute the same and more: labels may carry a
trailing dimension (several tokens per position, such as the sampled token and a teacher's top-k,
gathered in one pass that shares one ``logsumexp``), and ``top_k`` also returns the likeliest tokens
of each position (their log-probs descending, with no gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / temperature)[..., labels]``: logits ``[..., V]``, labels ``[...]``."""
    return log_probs_and_entropy(logits, labels, temperature, compute_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dimension."""
    scaled = _tempered(logits, temperature)
    return _entropy(scaled, torch.logsumexp(scaled, dim=-1))


def log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, compute_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` and (when ``compute_entropy``) the entropy, sharing one ``logsumexp``."""
    log_probs, entropy, _, _ = token_log_probs(logits, labels, temperature, compute_entropy=compute_entropy)
    return log_probs, entropy


def chunked_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_probs_and_entropy(hidden @ weight.T + bias, labels, ...)`` over ``chunk_size`` tokens at
    a time: hidden ``[..., H]``, weight ``[V, H]``, labels ``[...]``; outputs shaped like ``labels``
    (``chunked_token_log_probs`` says how)."""
    log_probs, entropy, _, _ = chunked_token_log_probs(
        hidden, weight, bias, labels, temperature, compute_entropy=compute_entropy, chunk_size=chunk_size
    )
    return log_probs, entropy


class TokenLogProbs(NamedTuple):
    """What ``token_log_probs`` and ``chunked_token_log_probs`` compute at each position: the log-probs
    of its labels (shaped like them), the entropy (or None), and its ``top_k`` likeliest tokens'
    log-probs, descending, with their ids (``[..., k]``, or None without ``top_k``)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    top_k_log_probs: torch.Tensor | None = None
    top_k_ids: torch.Tensor | None = None


def token_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    compute_entropy: bool = False,
    top_k: int = 0,
) -> TokenLogProbs:
    """Log-probs of ``labels`` under ``softmax(logits / temperature)``, the entropy when
    ``compute_entropy`` and the ``top_k`` likeliest tokens, all from one ``logsumexp``: logits
    ``[..., V]``, labels ``[...]`` (one token per position) or ``[..., m]`` (``m`` tokens per position,
    gathered at once: log-probs ``[..., m]``). The top-k log-probs carry no gradient."""
    several = _several_labels(labels, logits.dim())
    log_probs, entropy, _, top_log_probs, top_ids = _head_outputs(
        logits, labels if several else labels.unsqueeze(-1), temperature, compute_entropy, top_k
    )
    return TokenLogProbs(log_probs if several else log_probs.squeeze(-1), entropy, top_log_probs, top_ids)


def chunked_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    compute_entropy: bool = False,
    chunk_size: int = 1024,
) -> TokenLogProbs:
    """``token_log_probs(hidden @ weight.T + bias, labels, ...)`` over ``chunk_size`` tokens at a time:
    hidden ``[..., H]``, weight ``[V, H]``, labels ``[...]`` or ``[..., m]``.

    With gradients on and more than one chunk, the chunks run in one ``torch.autograd.Function``
    whose forward keeps no graph, only its inputs and two floats per token (the ``logsumexp`` and the
    entropy): autograd would otherwise keep every chunk's probabilities for backward, the whole
    ``[tokens, V]`` again. Its backward recomputes one chunk's logits at a time (one head matmul) and
    writes their gradient in closed form from the softmax ``p`` of the tempered logits ``z``:
    ``d log p_label / dz = onehot - p`` (summed over a position's labels) and
    ``dH / dz = -p (log p + H)``. A single chunk runs directly under plain autograd (nothing to bound,
    nothing to recompute).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    positions = hidden.shape[:-1]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(flat_hidden.shape[0], -1)
    _several_labels(labels, hidden.dim())
    if flat_labels.shape[0] <= chunk_size:
        outputs = _head_outputs(
            F.linear(flat_hidden, weight, bias), flat_labels, temperature, compute_entropy, top_k
        )
    elif torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad for tensor in (hidden, weight, bias)
    ):
        outputs = _ChunkedHeadLogProbs.apply(
            flat_hidden, weight, bias, flat_labels, temperature, compute_entropy, top_k, chunk_size
        )
    else:
        outputs = _chunked_forward(
            flat_hidden, weight, bias, flat_labels, temperature, compute_entropy, top_k, chunk_size
        )
    log_probs, entropy, _, top_log_probs, top_ids = outputs
    return TokenLogProbs(
        log_probs.reshape(labels.shape),
        None if entropy is None else entropy.reshape(positions),
        *(None if top is None else top.reshape(*positions, top_k) for top in (top_log_probs, top_ids)),
    )


def _several_labels(labels: torch.Tensor, logits_dim: int) -> bool:
    """Whether ``labels`` carry several tokens per position (a trailing dimension) for logits or hidden
    states of ``logits_dim`` dimensions; anything else is refused."""
    if labels.dim() not in (logits_dim - 1, logits_dim):
        raise ValueError(
            f"labels of {labels.dim()} dimensions for logits of {logits_dim}: expected one label per "
            f"position ({logits_dim - 1} dimensions) or several ({logits_dim}, the last one the labels)"
        )
    return labels.dim() == logits_dim


class _ChunkedHeadLogProbs(torch.autograd.Function):
    """``chunked_token_log_probs`` on flat ``[tokens, H]`` hidden states and ``[tokens, m]`` labels,
    with a backward that holds one chunk's ``[chunk, V]`` tensors at a time and differentiates the
    softmax in closed form (not op by op, as autograd would on a recomputed graph). Its outputs are
    ``_head_outputs``'; the top-k ones take no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, compute_entropy, top_k, chunk_size):
        log_probs, entropy, log_normaliser, top_log_probs, top_ids = _chunked_forward(
            hidden, weight, bias, labels, temperature, compute_entropy, top_k, chunk_size
        )
        ctx.save_for_backward(hidden, weight, bias, labels, log_normaliser, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: its term is skipped
        ctx.mark_non_differentiable(
            log_normaliser, *(top for top in (top_log_probs, top_ids) if top is not None)
        )
        return log_probs, entropy, log_normaliser, top_log_probs, top_ids

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy, _grad_log_normaliser, _grad_top_log_probs, _grad_top_ids):
        hidden, weight, bias, labels, log_normaliser, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 8
        # grad_W (and grad_b) sum one product per chunk: for float16/bfloat16 heads they add up in
        # float32, rounded once at the end, as one whole matmul (float32-accumulated) would round;
        # summing in the head's dtype would round every partial sum. The cost: one float32
        # [V, H] buffer for the length of this backward.
        accumulation = torch.float32 if weight.dtype in _LOW_PRECISION else weight.dtype
        grad_hidden = hidden.new_empty(hidden.shape) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=accumulation) if needs_weight else None
        grad_bias = torch.zeros_like(bias, dtype=accumulation) if needs_bias else None
        for start in range(0, labels.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            hidden_chunk = hidden[rows]
            grad_logits = _grad_logits(
                F.linear(hidden_chunk, weight, bias),
                labels[rows],
                ctx.temperature,
                log_normaliser[rows],
                None if grad_entropy is None else entropy[rows],
                None if grad_log_probs is None else grad_log_probs[rows],
                None if grad_entropy is None else grad_entropy[rows],
            )
            if needs_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if needs_weight:
                if accumulation == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.T, hidden_chunk)
                else:
                    grad_weight += grad_logits.T @ hidden_chunk
            if needs_bias:
                grad_bias += grad_logits.sum(0, dtype=accumulation)
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    top_k: int,
    chunk_size: int,
) -> _HeadOutputs:
    """``_head_outputs`` of the logits of flat ``hidden``, ``chunk_size`` rows at a time. The logits
    are in the head's dtype, as ``nn.Linear`` computes them; ``_tempered`` upcasts."""
    chunks = [
        _head_outputs(
            F.linear(hidden[start : start + chunk_size], weight, bias),
            labels[start : start + chunk_size],
            temperature,
            compute_entropy,
            top_k,
        )
        for start in range(0, labels.shape[0], chunk_size)
    ]
    return _HeadOutputs(
        *(None if parts[0] is None else torch.cat(parts) for parts in zip(*chunks, strict=True))
    )


def _grad_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    log_normaliser: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    """The gradient of ``sum(grad_log_probs * log_probs + grad_entropy * entropy)`` w.r.t. one
    chunk's ``logits`` ``[chunk, V]``, in the logits' dtype; either weight may be None (not used).
    ``labels`` and ``grad_log_probs`` are ``[chunk, m]``: ``m`` labels per token.

    With ``z = logits / temperature``, ``p = softmax(z)``: ``d log p_label / dz = onehot - p`` and
    ``dH / dz = -p (log p + H)``, so with ``g = sum_j g_lp_j`` over a token's labels
    ``dz = -p (g + g_H (log p + H)) + sum_j g_lp_j onehot_j`` and ``dlogits = dz / temperature``.
    Computed in float32 (or the logits' dtype, if wider) like the forward, in five passes over the
    chunk (the per-token weights folded into ``[chunk, 1]`` factors), in place: at most three
    ``[chunk, V]`` tensors at once.
    """
    dtype = logits.dtype
    # log p = logits / T - logsumexp in one pass, which also upcasts low-precision logits.
    log_p = torch.add(-log_normaliser.unsqueeze(-1), logits, alpha=1.0 / temperature)
    del logits
    grad = log_p.exp()
    scale = -1.0 / temperature  # the sign and the temperature go into [chunk, 1] weights
    labels_weight = None if grad_log_probs is None else scale * grad_log_probs.sum(-1, keepdim=True)
    if grad_entropy is None:
        del log_p
        grad.mul_(labels_weight)
    else:
        # -(g + g_H (log p + H)) / T = a log p + c, with a = -g_H / T, c = -(g + g_H H) / T
        slope = (scale * grad_entropy).unsqueeze(-1)
        offset = slope * entropy.unsqueeze(-1)
        if labels_weight is not None:
            offset += labels_weight
        grad.mul_(log_p.mul_(slope).add_(offset))
        del log_p
    if grad_log_probs is not None:
        grad.scatter_add_(-1, labels.long(), (grad_log_probs / temperature).to(grad.dtype))
    return grad.to(dtype)


class _HeadOutputs(NamedTuple):
    """``_head_outputs``' results: ``TokenLogProbs`` on ``[..., m]`` labels, and the ``logsumexp`` of
    each position's tempered logits (what the chunked backward recomputes the softmax from)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    log_normaliser: torch.Tensor
    top_k_log_probs: torch.Tensor | None
    top_k_ids: torch.Tensor | None


def _head_outputs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, compute_entropy: bool, top_k: int
) -> _HeadOutputs:
    """Log-probs of ``labels`` ``[..., m]`` (``[..., m]``), the entropy when ``compute_entropy``, the
    ``logsumexp`` of the tempered logits and, with ``top_k``, the likeliest tokens' log-probs
    (descending, detached) and ids ``[..., top_k]``."""
    if top_k < 0 or top_k > logits.shape[-1]:
        raise ValueError(f"top_k={top_k}: must be between 0 and the vocabulary size {logits.shape[-1]}")
    scaled = _tempered(logits, temperature)
    log_normaliser = torch.logsumexp(scaled, dim=-1)
    log_probs = scaled.gather(-1, labels.long()) - log_normaliser.unsqueeze(-1)
    entropy = _entropy(scaled, log_normaliser) if compute_entropy else None
    top_log_probs = top_ids = None
    if top_k:
        with torch.no_grad():
            top_scaled, top_ids = scaled.topk(top_k, dim=-1)
            top_log_probs = top_scaled - log_normaliser.unsqueeze(-1)
    return _HeadOutputs(log_probs, entropy, log_normaliser, top_log_probs, top_ids)


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be positive (greedy decoding has no log-probs)")
    if logits.dtype in _LOW_PRECISION:
        logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _entropy(scaled: torch.Tensor, log_normaliser: torch.Tensor) -> torch.Tensor:
    # H = -sum_v p_v log p_v on log p = z - logsumexp(z): unlike logsumexp(z) - sum_v p_v z_v, no
    # cancellation of two large terms when the distribution is peaked. The dot product avoids a
    # third vocabulary-sized tensor.
    log_p = scaled - log_normaliser.unsqueeze(-1)
    return -torch.einsum("...v,...v->...", log_p.exp(), log_p)
