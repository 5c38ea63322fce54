"""Vocabulary-parallel log-probs and entropy against core's ``log_probs_and_entropy`` on the whole
logits, in float64 on 2 spawned gloo ranks: values and gradients, with padded columns, several
temperatures; and a broken variant that must differ. One spawn runs both, the correct one first."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.distributed as dist

from verl_core.testing.spawn import spawn
from verl_core.toolkit import log_probs_and_entropy
from verl_megatron.weights import padded_vocab_size

pytestmark = pytest.mark.distributed

#: (vocabulary, temperature): 11 and 13 leave padded columns at 2 and 4 ranks.
CASES = [(12, 1.0), (11, 0.7), (13, 1.3)]


#: The variants ``compare_variants`` runs, in order: the correct one, then each broken one.
VARIANTS = (None, "entropy_backward_without_expected_logit")


def compare_variants(rank) -> None:
    """``compare_on_rank`` for each of ``VARIANTS``; each rank writes why each one failed (None:
    it did not) to ``results_rank<N>.json``. A broken variant is installed after the correct one ran."""
    results = {}
    for broken in VARIANTS:
        try:
            compare_on_rank(rank, broken)
            results[str(broken)] = None
        except AssertionError:
            results[str(broken)] = traceback.format_exc()
    (rank.workdir / f"results_rank{rank.rank}.json").write_text(json.dumps(results))


def compare_on_rank(rank, broken: str | None) -> None:
    from verl_megatron import vocab_parallel

    if broken == "entropy_backward_without_expected_logit":

        def backward(ctx, grad_log_probs, grad_entropy):  # -p * l instead of -p * (l - E)
            probs, finite, _, local, here = ctx.saved_tensors
            onehot = torch.zeros_like(probs).scatter_(
                -1, local.clamp(0, probs.shape[-1] - 1).unsqueeze(-1), 1.0
            )
            grad = (onehot * here.unsqueeze(-1) - probs) * grad_log_probs.unsqueeze(-1)
            grad = grad - probs * finite * grad_entropy.unsqueeze(-1)
            return grad / ctx.temperature, None, None, None, None, None, None

        vocab_parallel._VocabParallel.backward = staticmethod(backward)
    tp, index = rank.world_size, rank.rank
    for vocab, temperature in CASES:
        padded = padded_vocab_size(vocab, tp)
        generator = torch.Generator().manual_seed(vocab)
        full = torch.randn(3, 5, padded, generator=generator, dtype=torch.float64) * 3
        labels = torch.randint(0, vocab, (3, 5), generator=generator)
        weights = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)

        expected_logits = full[..., :vocab].clone().requires_grad_()
        log_probs, entropy = log_probs_and_entropy(expected_logits, labels, temperature, True)
        ((log_probs * weights[0]).sum() + (entropy * weights[1]).sum()).backward()

        width = padded // tp
        local = full[..., index * width : (index + 1) * width].clone().requires_grad_()
        got_log_probs, got_entropy = vocab_parallel.vocab_parallel_log_probs_and_entropy(
            local, labels, temperature, True, index * width, vocab, dist.group.WORLD
        )
        ((got_log_probs * weights[0]).sum() + (got_entropy * weights[1]).sum()).backward()

        expected_grad = torch.nn.functional.pad(expected_logits.grad, (0, padded - vocab))
        mine = expected_grad[..., index * width : (index + 1) * width]
        torch.testing.assert_close(got_log_probs.double(), log_probs.double(), atol=1e-6, rtol=0)
        torch.testing.assert_close(got_entropy.double(), entropy.double(), atol=1e-6, rtol=0)
        torch.testing.assert_close(local.grad, mine, atol=1e-6, rtol=0)
        without_entropy, none = vocab_parallel.vocab_parallel_log_probs_and_entropy(
            local.detach(), labels, temperature, False, index * width, vocab, dist.group.WORLD
        )
        assert none is None
        torch.testing.assert_close(without_entropy.double(), log_probs.detach().double(), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> list[dict[str, str | None]]:
    """Per rank, why each variant's comparison failed (None: it held)."""
    workdir = tmp_path_factory.mktemp("vocab_parallel")
    spawn(compare_variants, world_size=2, workdir=workdir, timeout_s=240)
    return [json.loads((workdir / f"results_rank{rank}.json").read_text()) for rank in range(2)]


def test_equals_the_whole_vocabulary(failures):
    assert [rank["None"] for rank in failures] == [None, None], failures


def test_an_entropy_gradient_without_the_expected_logit_is_caught(failures):
    for rank in failures:
        assert "Mismatched elements" in (rank["entropy_backward_without_expected_logit"] or ""), rank
