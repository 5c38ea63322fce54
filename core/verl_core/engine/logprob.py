"""Per-token log-probabilities and entropy from logits, with sampling temperature.

Both work on the tempered distribution ``softmax(logits / temperature)``, the one a rollout samples
from. Log-probs need only ``logsumexp`` and a gather (no softmax copy of the vocabulary); entropy needs
one probability tensor. Low-precision logits are upcast to float32 first.

``chunked_log_probs_and_entropy`` computes the same from the final hidden states and the LM head's
weight, a chunk of tokens at a time, so that the ``[tokens, vocabulary]`` logits (and their float32,
tempered and probability copies) exist for one chunk at a time only: with a 150k vocabulary they are
what runs out of memory first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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
    scaled = _tempered(logits, temperature)
    log_normaliser = torch.logsumexp(scaled, dim=-1)
    label_logits = scaled.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1)
    log_probs = label_logits - log_normaliser
    entropy = _entropy(scaled, log_normaliser) if compute_entropy else None
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
    a time: hidden ``[..., H]``, weight ``[V, H]``, labels ``[...]``; outputs shaped like ``labels``.

    With gradients on and more than one chunk, each chunk runs under non-reentrant activation
    checkpointing: otherwise autograd would keep every chunk's probabilities for backward, which is
    the whole ``[tokens, V]`` again; backward recomputes one chunk's logits at a time instead. A single
    chunk runs directly (nothing to bound, nothing to recompute).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    tokens = flat_labels.shape[0]
    if tokens <= chunk_size:
        log_probs, entropy = _head_log_probs(
            flat_hidden, weight, bias, flat_labels, temperature, compute_entropy
        )
    else:
        recompute = torch.is_grad_enabled() and any(
            tensor is not None and tensor.requires_grad for tensor in (hidden, weight, bias)
        )
        chunks = []
        for start in range(0, tokens, chunk_size):
            args = (
                flat_hidden[start : start + chunk_size],
                weight,
                bias,
                flat_labels[start : start + chunk_size],
                temperature,
                compute_entropy,
            )
            chunks.append(
                checkpoint(_head_log_probs, *args, use_reentrant=False)
                if recompute
                else _head_log_probs(*args)
            )
        log_probs = torch.cat([chunk_log_probs for chunk_log_probs, _ in chunks])
        entropy = torch.cat([chunk_entropy for _, chunk_entropy in chunks]) if compute_entropy else None
    return log_probs.reshape(labels.shape), None if entropy is None else entropy.reshape(labels.shape)


def _head_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The logits in the head's dtype, as ``nn.Linear`` computes them; ``_tempered`` upcasts.
    return log_probs_and_entropy(F.linear(hidden, weight, bias), labels, temperature, compute_entropy)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be positive (greedy decoding has no log-probs)")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def _entropy(scaled: torch.Tensor, log_normaliser: torch.Tensor) -> torch.Tensor:
    # H = -sum_v p_v log p_v on log p = z - logsumexp(z): unlike logsumexp(z) - sum_v p_v z_v, no
    # cancellation of two large terms when the distribution is peaked. The dot product avoids a
    # third vocabulary-sized tensor.
    log_p = scaled - log_normaliser.unsqueeze(-1)
    return -torch.einsum("...v,...v->...", log_p.exp(), log_p)
