"""Log-probs and entropy of the tempered distribution, against the formulas written out with loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.toolkit import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple[list, list]:
    """p_v = exp(z_v / T) / sum_w exp(z_w / T), log p[label], and H = -sum_v p_v log p_v, per row."""
    log_probs, entropies = [], []
    for row, label in zip(logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1), strict=True):
        scaled = [float(z) / temperature for z in row]
        shift = max(scaled)
        normaliser = sum(math.exp(z - shift) for z in scaled)
        log_p = [z - shift - math.log(normaliser) for z in scaled]
        log_probs.append(log_p[int(label)])
        entropies.append(-sum(math.exp(lp) * lp for lp in log_p))
    return log_probs, entropies


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(min_value=1, max_value=3),
    length=st.integers(min_value=1, max_value=5),
    vocab=st.integers(min_value=2, max_value=40),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    scale=st.sampled_from([0.1, 5.0, 60.0]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_log_probs_and_entropy_match_the_formula(batch, length, vocab, temperature, scale, seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=generator) * scale
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    log_probs, entropy = log_probs_and_entropy(logits, labels, temperature, compute_entropy=True)
    expected_log_probs, expected_entropy = reference(logits, labels, temperature)
    assert log_probs.shape == entropy.shape == (batch, length)
    torch.testing.assert_close(
        log_probs.flatten().double(),
        torch.tensor(expected_log_probs, dtype=torch.float64),
        atol=1e-4,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        entropy.flatten().double(), torch.tensor(expected_entropy, dtype=torch.float64), atol=1e-4, rtol=1e-5
    )
    # The single-purpose entry points agree with the shared one.
    torch.testing.assert_close(log_probs_from_logits(logits, labels, temperature), log_probs)
    torch.testing.assert_close(entropy_from_logits(logits, temperature), entropy)


def test_entropy_is_optional_and_gradients_flow() -> None:
    logits = torch.randn(2, 3, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    log_probs, entropy = log_probs_and_entropy(logits, labels, temperature=0.5)
    assert entropy is None
    log_probs.sum().backward()
    # d log p_label / d z = (onehot - p) / T: rows of the gradient sum to zero.
    torch.testing.assert_close(logits.grad.sum(-1), torch.zeros(2, 3), atol=1e-6, rtol=0)


def test_low_precision_logits_are_upcast() -> None:
    logits = torch.randn(4, 50) * 20
    labels = torch.randint(0, 50, (4,))
    low = log_probs_from_logits(logits.bfloat16(), labels)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, log_probs_from_logits(logits.bfloat16().float(), labels))


def test_non_positive_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match=r"temperature=0.*must be positive"):
        log_probs_from_logits(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), temperature=0)
