"""The critic's clipped value loss against the formula written out per token, with global normalisation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algos.value_loss import clipped_value_loss_matrix, compute_value_loss
from verl_core.config.algorithm import CriticLossConfig
from verl_core.data.batch import GlobalCounts


def reference_token(vpred: float, old_value: float, ret: float, clip: float) -> tuple[float, float, bool]:
    """Loss, d loss / d vpred, and whether the clipped term is the larger one, for one token."""
    clipped_vpred = min(max(vpred, old_value - clip), old_value + clip)
    unclipped, clipped = (vpred - ret) ** 2, (clipped_vpred - ret) ** 2
    # The clipped term only exceeds the unclipped one when clamping moved vpred: then it is flat in vpred.
    gradient = vpred - ret if unclipped >= clipped else 0.0
    return 0.5 * max(unclipped, clipped), gradient, clipped > unclipped


def reference(vpreds, values, returns, mask, clip, mode, dp_size=1):
    """The full-batch loss, its gradient and clip fraction; ``mode`` is token-mean or seq-mean-token-mean."""
    num_tokens = sum(sum(row) for row in mask)
    loss, clipped_tokens = 0.0, 0
    gradient = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        length = sum(row)
        for t, m in enumerate(row):
            if not m:
                continue
            token_loss, token_gradient, was_clipped = reference_token(
                vpreds[i][t], values[i][t], returns[i][t], clip
            )
            weight = 1 / num_tokens if mode == "token-mean" else 1 / (length * len(mask))
            loss += weight * token_loss * dp_size
            gradient[i][t] = weight * token_gradient * dp_size
            clipped_tokens += was_clipped
    return loss, gradient, clipped_tokens / max(num_tokens, 1)


VPREDS = [[0.0, 2.0, -1.0, 5.0], [1.2, 0.4, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]]
VALUES = [[0.1, 0.5, 0.0, 9.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
RETURNS = [[1.0, 0.3, 0.4, -9.0], [2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


def tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_clipped_value_loss_matches_reference(mode):
    config = CriticLossConfig(cliprange_value=0.5, loss_agg_mode=mode)
    vpreds = tensor(VPREDS).requires_grad_()
    # Seq-mean modes count every row (an empty response adds one sequence and no loss).
    counts = GlobalCounts(num_tokens=5, num_seqs=3, dp_size=1, max_response_len=4)
    loss, metrics = compute_value_loss(
        vpreds=vpreds,
        values=tensor(VALUES),
        returns=tensor(RETURNS),
        response_mask=torch.tensor(MASK),
        config=config,
        counts=counts,
    )
    loss.backward()
    expected_loss, expected_gradient, clipfrac = reference(VPREDS, VALUES, RETURNS, MASK, 0.5, mode)
    assert loss.item() == pytest.approx(expected_loss)
    torch.testing.assert_close(vpreds.grad, tensor(expected_gradient))
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipfrac) and 0 < clipfrac < 1
    assert metrics["critic/vf_loss"] == pytest.approx(expected_loss)
    assert metrics["critic/vpred_mean"] == pytest.approx((0.0 + 2.0 - 1.0 + 1.2 + 0.4) / 5)


def test_loss_matrix_is_zero_at_masked_positions_even_with_nan():
    vpreds = torch.where(torch.tensor(MASK).bool(), tensor(VPREDS), float("nan"))
    loss_mat, _ = clipped_value_loss_matrix(
        vpreds=vpreds,
        values=tensor(VALUES),
        returns=tensor(RETURNS),
        response_mask=torch.tensor(MASK),
        cliprange_value=0.2,
    )
    assert not loss_mat.isnan().any()
    assert (loss_mat[torch.tensor(MASK) == 0] == 0).all()


def test_micro_batches_and_dp_shards_sum_to_the_full_batch():
    # Two DP ranks, the first holding two micro-batches: each part normalises by the global counts.
    config = CriticLossConfig(cliprange_value=0.3)
    counts = GlobalCounts(num_tokens=5, num_seqs=3, dp_size=2, max_response_len=4)
    vpreds = tensor(VPREDS).requires_grad_()
    total = 0.0
    for rows in ([0], [1], [2]):
        loss, _ = compute_value_loss(
            vpreds=vpreds[rows],
            values=tensor(VALUES)[rows],
            returns=tensor(RETURNS)[rows],
            response_mask=torch.tensor(MASK)[rows],
            config=config,
            counts=counts,
        )
        loss.backward()
        total += loss.item()
    expected_loss, expected_gradient, _ = reference(
        VPREDS, VALUES, RETURNS, MASK, 0.3, "token-mean", dp_size=2
    )
    assert total == pytest.approx(expected_loss)  # dp_size times the loss: DDP averages the gradients
    torch.testing.assert_close(vpreds.grad, tensor(expected_gradient))


def test_unknown_aggregation_mode_names_the_critic_key():
    with pytest.raises(
        ValueError, match=r"critic\.loss\.loss_agg_mode='mean' is not a loss aggregation mode.*token-mean"
    ):
        compute_value_loss(
            vpreds=tensor(VPREDS),
            values=tensor(VALUES),
            returns=tensor(RETURNS),
            response_mask=torch.tensor(MASK),
            config=CriticLossConfig(loss_agg_mode="mean"),  # type: ignore[arg-type]
            counts=GlobalCounts(num_tokens=5, num_seqs=3),
        )


finite = st.floats(-5, 5, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(finite, finite, finite), min_size=1, max_size=12),
    st.floats(0.01, 2.0),
)
def test_clipping_never_lowers_the_loss_and_only_flattens_the_gradient(tokens, clip):
    vpreds = torch.tensor([[v for v, _, _ in tokens]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[o for _, o, _ in tokens]], dtype=torch.float64)
    returns = torch.tensor([[r for _, _, r in tokens]], dtype=torch.float64)
    loss_mat, metrics = clipped_value_loss_matrix(
        vpreds=vpreds,
        values=values,
        returns=returns,
        response_mask=torch.ones_like(values),
        cliprange_value=clip,
    )
    loss_mat.sum().backward()
    clipped_count = 0
    for t, (vpred, old_value, ret) in enumerate(tokens):
        token_loss, token_gradient, was_clipped = reference_token(vpred, old_value, ret, clip)
        assert loss_mat[0, t].item() == pytest.approx(token_loss)
        assert loss_mat[0, t].item() >= 0.5 * (vpred - ret) ** 2 - 1e-12  # max with the unclipped term
        clipped_vpred = min(max(vpred, old_value - clip), old_value + clip)
        if (vpred - ret) ** 2 != (clipped_vpred - ret) ** 2:  # at an exact tie max() splits the gradient
            assert vpreds.grad[0, t].item() == pytest.approx(token_gradient)
        clipped_count += was_clipped
    assert metrics["critic/vf_clipfrac"] == pytest.approx(clipped_count / len(tokens))
