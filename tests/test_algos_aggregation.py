"""Loss aggregation: each mode against its full-batch formula written out with loops, and invariance of
loss and gradient to any split into data-parallel shards and micro-batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.algos.aggregation import LOSS_AGG_MODES, agg_loss, masked_mean
from verl_core.data.batch import GlobalCounts

#: Double precision, so that comparisons test the algebra, not float32 rounding.
F64 = torch.float64


def reference_loss(loss_mat: torch.Tensor, mask: list[list[int]], mode: str) -> torch.Tensor:
    """The full-batch loss of ``mode`` (one process, no DP scaling), with loops over sequences and tokens."""
    num_seqs, response_len = len(mask), len(mask[0])
    num_tokens = sum(sum(row) for row in mask)
    total = torch.zeros((), dtype=F64)
    for i in range(num_seqs):
        length = sum(mask[i])
        for t in range(response_len):
            if not mask[i][t]:
                continue
            if mode == "token-mean":
                weight = 1.0 / num_tokens
            elif mode == "token-sum":
                weight = 1.0
            elif mode == "seq-mean-token-sum":
                weight = 1.0 / num_seqs
            elif mode == "seq-mean-token-mean":
                weight = 1.0 / (num_seqs * length)
            else:  # seq-mean-token-sum-norm: Dr. GRPO's constant horizon
                weight = 1.0 / (num_seqs * response_len)
            total = total + weight * loss_mat[i, t]
    return total


def model_loss_mat(weights: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A per-token loss that depends non-linearly on parameters shared by all ranks (``weights[t]``)."""
    return x * weights[: x.shape[-1]] + y * weights[: x.shape[-1]].square()


def full_counts(mask: torch.Tensor, dp_size: int = 1) -> GlobalCounts:
    return GlobalCounts(int(mask.sum()), mask.shape[0], dp_size, mask.shape[1])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_full_batch_matches_the_written_out_formula(mode: str) -> None:
    # Rows: full, right-padded, empty, with an observation span (mask 0 inside the response).
    mask_rows = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 1, 1]]
    mask = torch.tensor(mask_rows)
    loss_mat = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    loss_mat[mask == 0] = 1e6  # values at masked positions must not leak
    loss = agg_loss(loss_mat, mask, mode, full_counts(mask))
    torch.testing.assert_close(loss, reference_loss(loss_mat, mask_rows, mode))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_inf_and_nan_leak_neither_into_loss_nor_gradient(mode: str) -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    raw = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64, requires_grad=True)
    poison = torch.tensor([[0.0, 0.0, float("inf")], [float("nan"), float("-inf"), 0.0]], dtype=F64)
    loss = agg_loss(raw + poison, mask, mode, full_counts(mask))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(raw.grad).all()
    assert (raw.grad[mask == 0] == 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_step_without_tokens_gives_zero_not_nan(mode: str) -> None:
    mask = torch.zeros(2, 3, dtype=torch.int64)
    loss = agg_loss(torch.randn(2, 3, dtype=F64), mask, mode, full_counts(mask))
    assert loss.item() == 0.0


def test_unknown_mode_lists_the_valid_ones() -> None:
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="loss_agg_mode='token_mean'") as error:
        agg_loss(torch.zeros(1, 2), mask, "token_mean", full_counts(mask))
    for mode in LOSS_AGG_MODES:
        assert mode in str(error.value)


def test_token_sum_norm_refuses_counts_without_response_length() -> None:
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="max_response_len.*compute_global_counts"):
        agg_loss(torch.zeros(1, 2), mask, "seq-mean-token-sum-norm", GlobalCounts(2, 1))


def test_masked_mean() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(values, mask), torch.tensor(2.0))
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 3.0]))
    torch.testing.assert_close(masked_mean(values, torch.zeros_like(mask), dim=-1), torch.zeros(2))


@st.composite
def split_batches(draw: st.DrawFn) -> dict:
    """A batch, and a split of its sequences into DP shards (any assignment) and micro-batches."""
    num_seqs = draw(st.integers(1, 7))
    response_len = draw(st.integers(1, 5))
    mask = draw(
        st.lists(
            st.lists(st.integers(0, 1), min_size=response_len, max_size=response_len),
            min_size=num_seqs,
            max_size=num_seqs,
        )
    )
    floats = st.floats(-3, 3, allow_nan=False)
    cells = st.lists(floats, min_size=num_seqs * response_len, max_size=num_seqs * response_len)
    x = torch.tensor(draw(cells), dtype=F64).view(num_seqs, response_len)
    y = torch.tensor(draw(cells), dtype=F64).view(num_seqs, response_len)
    weights = torch.tensor(draw(st.lists(floats, min_size=response_len, max_size=response_len)), dtype=F64)
    dp_size = draw(st.integers(1, min(3, num_seqs)))
    order = draw(st.permutations(range(num_seqs)))
    cut_points = st.integers(1, max(num_seqs - 1, 1))
    cuts = sorted(draw(st.lists(cut_points, min_size=dp_size - 1, max_size=dp_size - 1, unique=True)))
    shards = [order[a:b] for a, b in zip([0, *cuts], [*cuts, num_seqs], strict=True)]
    micro_batches = []
    for shard in shards:
        sizes = []
        while sum(sizes) < len(shard):
            sizes.append(draw(st.integers(1, len(shard) - sum(sizes))))
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        micro_batches.append([shard[s : s + n] for s, n in zip(starts, sizes, strict=True)])
    # Dynamic batching may drop a micro-batch's trailing padding columns.
    trim = draw(st.booleans())
    return dict(mask=mask, x=x, y=y, weights=weights, micro_batches=micro_batches, trim=trim)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@settings(max_examples=60, deadline=None)
@given(case=split_batches())
def test_split_into_micro_batches_and_dp_shards_gives_the_full_batch_loss_and_gradient(
    mode: str, case: dict
) -> None:
    mask = torch.tensor(case["mask"])
    x, y = case["x"], case["y"]
    dp_size = len(case["micro_batches"])

    weights = case["weights"].clone().requires_grad_()
    expected_loss = reference_loss(model_loss_mat(weights, x, y), case["mask"], mode)
    (expected_grad,) = (
        torch.autograd.grad(expected_loss, weights)
        if expected_loss.requires_grad
        else (torch.zeros_like(weights),)
    )

    counts = full_counts(mask, dp_size)
    summed_loss = torch.zeros((), dtype=F64)
    rank_grads = []
    for rank_micro_batches in case["micro_batches"]:
        rank_weights = case["weights"].clone().requires_grad_()  # each rank holds a replica
        for rows in rank_micro_batches:
            micro_mask = mask[rows]
            if case["trim"]:
                kept = int(micro_mask.any(0).nonzero().max()) + 1 if micro_mask.any() else 1
                micro_mask = micro_mask[:, :kept]
            width = micro_mask.shape[1]
            loss = agg_loss(
                model_loss_mat(rank_weights, x[rows, :width], y[rows, :width]), micro_mask, mode, counts
            )
            loss.backward()  # gradient accumulation over micro-batches
            summed_loss = summed_loss + loss.detach()
        rank_grads.append(rank_weights.grad if rank_weights.grad is not None else torch.zeros_like(weights))
    averaged_grad = torch.stack(rank_grads).mean(0)  # what DDP / FSDP all-reduce does

    torch.testing.assert_close(summed_loss / dp_size, expected_loss.detach())
    torch.testing.assert_close(averaged_grad, expected_grad)
