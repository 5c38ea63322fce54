"""On-policy distillation's signals against the formulas written out: the reverse-KL reward per token,
and GKD's generalised Jensen-Shannon divergence over the teacher's top-k plus one tail outcome (at
``k`` = the vocabulary, the full-vocabulary divergence; at beta 0 and 1, forward and reverse KL).
Broken variants (the teacher's log-probs one position off, the response mask forgotten, the tail
dropped) fail the same checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from verl_core.algos.distillation import generalized_jsd, gkd_loss, reverse_kl_rewards, with_tail
from verl_core.data import GlobalCounts

# -- references, written out one position at a time in float64 ------------------------------------


def reward_reference(log_probs, teacher_log_probs, mask) -> torch.Tensor:
    rows, width = log_probs.shape
    out = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        for t in range(width):
            if mask[i, t]:
                out[i, t] = float(teacher_log_probs[i, t]) - float(log_probs[i, t])
    return out


def jsd_reference(student: list[float], teacher: list[float], beta: float) -> float:
    """One position: both sides' probabilities over the k tokens, then the rest as one outcome."""
    s = [math.exp(v) for v in student]
    t = [math.exp(v) for v in teacher]
    s.append(max(1.0 - sum(s), 1e-30))
    t.append(max(1.0 - sum(t), 1e-30))

    def kl(p, q):
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = [beta * ti + (1 - beta) * si for si, ti in zip(s, t, strict=True)]
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def full_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """The divergence over the whole vocabulary, from softmax of each side's logits."""
    s, t = student_logits.double().softmax(-1), teacher_logits.double().softmax(-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0.0:
        return kl(t, s)
    if beta == 1.0:
        return kl(s, t)
    m = beta * t + (1 - beta) * s
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


#: How far a tail's probability (1 minus the k probabilities of float64 log-probs, log_softmax's rounding
#: included: about 1e-16 of the logits' size each) can be from the true one, with room.
TAIL_ROUNDING = 1e-14


def within_tail_rounding(student_top: torch.Tensor, teacher_top: torch.Tensor) -> torch.Tensor:
    """Per position, how far the divergence may move with each side's tail off by ``TAIL_ROUNDING``: a
    tail term ``p log(p / q)`` moves by about ``p d / q`` with ``q``, ``d (1 + |log(p / q)|)`` with ``p``.
    Where the teacher's top-k hold all but 1e-12 of its mass and the student's do not, the tail (and so
    the divergence) is known to no better than that, whatever computes it from top-k log-probs."""
    student_tail, teacher_tail = with_tail(student_top)[..., -1], with_tail(teacher_top)[..., -1]
    log_ratio = student_tail - teacher_tail
    return TAIL_ROUNDING * (log_ratio.exp() + (-log_ratio).exp() + 2 * (1 + log_ratio.abs()))


# -- the distributions under test ------------------------------------------------------------------


@st.composite
def scored_responses(draw):
    """A batch of responses: the student's and the teacher's log-probs of the sampled tokens, a
    response mask (right-padded, at least one token), and values on padding that must not count."""
    rows = draw(st.integers(1, 4))
    width = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 5
    teacher = -torch.rand(rows, width, generator=generator, dtype=torch.float64) * 5
    lengths = [draw(st.integers(1, width)) for _ in range(rows)]
    mask = torch.tensor([[int(t < length) for t in range(width)] for length in lengths])
    return log_probs, teacher, mask


def top_k_of(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = logits.double().log_softmax(-1)
    return log_probs.topk(k, dim=-1)


def seeded_logits(positions: int, vocab: int, seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student logits ``[positions, vocab]``, normal with standard deviation ``scale``."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(positions, vocab, generator=generator, dtype=torch.float64) * scale
    student = torch.randn(positions, vocab, generator=generator, dtype=torch.float64) * scale
    return teacher, student


@st.composite
def teacher_and_student(draw):
    """Teacher and student logits over a small vocabulary at a few positions, and the teacher's top-k."""
    vocab = draw(st.integers(2, 12))
    k = draw(st.integers(1, vocab))
    positions = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.5, 2.0, 8.0]))  # flat to peaked
    beta = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    return *seeded_logits(positions, vocab, seed, scale), k, beta


#: Cases drawn in CI where the tails are known to a few parts in 1e4 only (``within_tail_rounding``):
#: the teacher's top-k hold all but 4e-12, 4e-14 and 1e-13 of its mass, the student's far less of its.
TINY_TEACHER_TAILS = [
    (*seeded_logits(1, 2, seed=3029, scale=8.0), 1, 1.0),
    (*seeded_logits(1, 11, seed=4, scale=8.0), 10, 1.0),
    (*seeded_logits(5, 11, seed=1, scale=8.0), 10, 1.0),
]


def student_at(student_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return student_logits.double().log_softmax(-1).gather(-1, ids)


# -- the reward ------------------------------------------------------------------------------------


def broken_reward_shifted(log_probs, teacher_log_probs, mask):
    """The teacher's log-probs taken one position late (the logits at P + t, not P + t - 1)."""
    return reverse_kl_rewards(log_probs, torch.roll(teacher_log_probs, 1, dims=-1), mask)


def broken_reward_unmasked(log_probs, teacher_log_probs, mask):
    return teacher_log_probs - log_probs


def reward_matches(reward_fn, log_probs, teacher, mask) -> bool:
    return torch.allclose(reward_fn(log_probs, teacher, mask), reward_reference(log_probs, teacher, mask))


@settings(max_examples=60, deadline=None)
@given(scored_responses())
def test_reverse_kl_reward_is_the_formula_written_out(responses):
    assert reward_matches(reverse_kl_rewards, *responses)


# A batch where both broken rewards part from the right one: padding, and tokens that differ.
PARTING = (
    torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], dtype=torch.float64),
    torch.tensor([[-0.2, -1.5, -3.0], [-2.0, -0.1, -0.7]], dtype=torch.float64),
    torch.tensor([[1, 1, 0], [1, 1, 1]]),
)


@pytest.mark.parametrize("broken", [broken_reward_shifted, broken_reward_unmasked])
def test_broken_rewards_fail_the_reference(broken):
    assert reward_matches(reverse_kl_rewards, *PARTING)
    assert not reward_matches(broken, *PARTING)


def test_the_reward_is_minus_the_reverse_kl_in_expectation():
    """Summed over the student's own distribution, ``E_{y ~ S}[log T(y) - log S(y)] = -KL(S || T)``."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(7, dtype=torch.float64, generator=generator).log_softmax(-1)
    teacher = torch.randn(7, dtype=torch.float64, generator=generator).log_softmax(-1)
    per_token = reverse_kl_rewards(student[None], teacher[None], torch.ones(1, 7))[0]
    expected = (student.exp() * per_token).sum()
    assert torch.allclose(expected, -(student.exp() * (student - teacher)).sum())


# -- the divergence --------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(teacher_and_student())
@example((torch.tensor([[30.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, 30.0]]), 1, 0.5))  # tails near 0, 1
@example(TINY_TEACHER_TAILS[2])
def test_jsd_is_the_formula_written_out(case):
    teacher_logits, student_logits, k, beta = case
    teacher_top, ids = top_k_of(teacher_logits, k)
    student = student_at(student_logits, ids)
    got = generalized_jsd(student, teacher_top, beta)
    expected = torch.tensor(
        [jsd_reference(s.tolist(), t.tolist(), beta) for s, t in zip(student, teacher_top, strict=True)],
        dtype=torch.float64,
    )
    slack = 1e-6 + 1e-4 * expected.abs() + within_tail_rounding(student, teacher_top)
    assert ((got.double() - expected).abs() <= slack).all()
    assert (got >= -1e-6).all()


@settings(max_examples=40, deadline=None)
@given(teacher_and_student())
@example(TINY_TEACHER_TAILS[0])
@example(TINY_TEACHER_TAILS[1])
def test_jsd_over_the_whole_vocabulary_is_the_full_divergence_and_bounds_the_top_k(case):
    teacher_logits, student_logits, k, beta = case
    vocab = teacher_logits.shape[-1]
    teacher_all, all_ids = top_k_of(teacher_logits, vocab)
    whole = generalized_jsd(student_at(student_logits, all_ids), teacher_all, beta)
    assert torch.allclose(
        whole.double(), full_jsd(student_logits, teacher_logits, beta), rtol=1e-4, atol=1e-6
    )
    teacher_top, ids = top_k_of(teacher_logits, k)
    # Merging the tail can only lower a divergence, to the precision the tail has.
    student_top = student_at(student_logits, ids)
    bound = whole + 1e-6 + within_tail_rounding(student_top, teacher_top)
    assert (generalized_jsd(student_top, teacher_top, beta) <= bound).all()


def test_jsd_is_zero_between_equal_distributions_and_its_ends_are_the_two_kls():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]], dtype=torch.float64)
    top, ids = top_k_of(logits, 2)
    for beta in (0.0, 0.3, 1.0):
        assert generalized_jsd(student_at(logits, ids), top, beta).abs().max() < 1e-12
    other = torch.tensor([[0.0, 2.0, 1.0, -1.0]], dtype=torch.float64)
    top, ids = top_k_of(logits, 4)
    student = student_at(other, ids)
    forward = (top.exp() * (top - student)).sum(-1)  # KL(T || S)
    reverse = (student.exp() * (student - top)).sum(-1)  # KL(S || T)
    assert torch.allclose(generalized_jsd(student, top, 0.0).double(), forward, atol=1e-9)
    assert torch.allclose(generalized_jsd(student, top, 1.0).double(), reverse, atol=1e-9)
    with pytest.raises(ValueError, match=r"beta=1.5: must be within \[0, 1\]"):
        generalized_jsd(student, top, 1.5)


def test_dropping_the_tail_is_caught():
    """Renormalising both sides to their top-k (no tail outcome) is another divergence: the reference
    tells it apart wherever the top-k do not hold all the mass."""
    teacher_logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]], dtype=torch.float64)
    student_logits = torch.tensor([[0.0, 2.5, 1.0, 1.0]], dtype=torch.float64)
    top, ids = top_k_of(teacher_logits, 2)
    student = student_at(student_logits, ids)
    renormalised = generalized_jsd(student.log_softmax(-1), top.log_softmax(-1), 0.5)
    expected = jsd_reference(student[0].tolist(), top[0].tolist(), 0.5)
    assert math.isclose(float(generalized_jsd(student, top, 0.5)[0]), expected, rel_tol=1e-9)
    assert not math.isclose(float(renormalised[0]), expected, rel_tol=1e-3)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_has_finite_gradients_that_autograd_checks(beta):
    generator = torch.Generator().manual_seed(1)
    teacher_logits = torch.randn(3, 6, generator=generator, dtype=torch.float64) * 3
    top, ids = top_k_of(teacher_logits, 3)
    student_logits = torch.randn(3, 6, generator=generator, dtype=torch.float64, requires_grad=True)

    def divergence(logits):
        return generalized_jsd(student_at(logits, ids), top, beta)

    assert torch.autograd.gradcheck(divergence, (student_logits,))
    # Top-k that hold all the mass (k = V): the tail is clamped, the gradient stays finite.
    top, ids = top_k_of(teacher_logits, 6)
    generalized_jsd(student_at(student_logits, ids), top, beta).sum().backward()
    assert torch.isfinite(student_logits.grad).all()


def test_with_tail_adds_what_the_top_k_leave():
    log_probs = torch.tensor([0.5, 0.25]).log()
    assert torch.allclose(with_tail(log_probs).exp(), torch.tensor([0.5, 0.25, 0.25]))


# -- the loss ----------------------------------------------------------------------------------------


def test_gkd_loss_is_the_token_mean_over_response_tokens_only():
    """Aggregated like the policy loss over the step's global counts; padding (where the divergence is
    large here) counts for nothing; forgetting the mask is caught."""
    generator = torch.Generator().manual_seed(2)
    teacher_top, ids = top_k_of(torch.randn(2, 3, 5, generator=generator) * 2, 2)
    student = student_at(torch.randn(2, 3, 5, generator=generator) * 2, ids).float()
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    counts = GlobalCounts(num_tokens=int(mask.sum()), num_seqs=2, dp_size=1, max_response_len=3)
    loss, metrics = gkd_loss(
        candidate_log_probs=student,
        teacher_top_k_log_probs=teacher_top.float(),
        response_mask=mask,
        beta=0.5,
        loss_agg_mode="token-mean",
        counts=counts,
    )
    per_position = [
        jsd_reference(student[i, t].tolist(), teacher_top[i, t].tolist(), 0.5)
        for i in range(2)
        for t in range(3)
        if mask[i, t]
    ]
    assert math.isclose(float(loss), sum(per_position) / len(per_position), rel_tol=1e-4)
    assert math.isclose(metrics["distillation/jsd"], float(loss), rel_tol=1e-4)
    unmasked = generalized_jsd(student, teacher_top.float(), 0.5).mean()
    assert not math.isclose(float(unmasked), float(loss), rel_tol=1e-3)
    # The teacher's top-k one position late (the logits at P + t): another loss, which the reference tells.
    shifted, _ = gkd_loss(
        candidate_log_probs=student,
        teacher_top_k_log_probs=torch.roll(teacher_top.float(), 1, dims=1),
        response_mask=mask,
        beta=0.5,
        loss_agg_mode="token-mean",
        counts=counts,
    )
    assert not math.isclose(float(shifted), sum(per_position) / len(per_position), rel_tol=1e-3)
