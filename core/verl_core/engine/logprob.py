"""Per-token log-probabilities and entropy from logits, with sampling temperature.

Both work on the tempered distribution ``softmax(logits / temperature)``, the one a rollout samples
from. Log-probs need only ``logsumexp`` and a gather (no softmax copy of the vocabulary); entropy needs
one probability tensor. Low-precision logits are upcast to float32 first.
"""

from __future__ import annotations

import torch


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
