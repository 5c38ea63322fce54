"""Micro-batching: every sample exactly once, budgets respected, batch order restored exactly."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_core.config.engine import MicroBatchConfig
from verl_core.data import microbatch
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, responses_batch, select_rows
from verl_core.data.microbatch import at_least, budget_units, partition_by_token_budget, split_micro_batches

lengths_strategy = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=24)


def make_batch(lengths: list[int], width: int = 40) -> TensorDict:
    """Sequences with ``lengths`` real tokens (left-padded); row ``i`` is filled with the value ``i``."""
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    ids = torch.arange(len(lengths)).unsqueeze(-1).expand(-1, width).clone()
    return TensorDict({INPUT_IDS: ids, ATTENTION_MASK: mask}, batch_size=[len(lengths)])


def check_split_is_a_permutation(batch: TensorDict, split) -> None:
    rows = [int(row) for micro in split.micro_batches for row in micro[INPUT_IDS][:, 0]]
    assert sorted(rows) == list(range(batch.batch_size[0]))  # every sample exactly once
    assert all(micro.batch_size[0] > 0 for micro in split.micro_batches)
    for index, micro in zip(split.indices, split.micro_batches, strict=True):
        assert torch.equal(micro[INPUT_IDS], batch[INPUT_IDS][index])
    # Outputs computed per micro-batch come back in batch order, tensors and TensorDicts alike.
    outputs = [micro[INPUT_IDS].float() * 2 for micro in split.micro_batches]
    assert torch.equal(split.restore(outputs), batch[INPUT_IDS].float() * 2)
    assert torch.equal(split.restore(split.micro_batches)[INPUT_IDS], batch[INPUT_IDS])


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_strategy, micro_batch_size=st.integers(min_value=1, max_value=30))
def test_count_mode_uses_the_fewest_micro_batches_within_size(
    lengths: list[int], micro_batch_size: int
) -> None:
    batch = make_batch(lengths)
    split = split_micro_batches(batch, MicroBatchConfig(micro_batch_size=micro_batch_size))
    check_split_is_a_permutation(batch, split)
    assert len(split.micro_batches) == math.ceil(len(lengths) / micro_batch_size)
    assert all(micro.batch_size[0] <= micro_batch_size for micro in split.micro_batches)
    # Count mode keeps contiguous order: no regrouping.
    assert torch.equal(split.restore_index, torch.arange(len(lengths)))


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=60))
def test_token_budget_mode_respects_the_budget(lengths: list[int], budget: int) -> None:
    batch = make_batch(lengths)
    split = split_micro_batches(batch, MicroBatchConfig(use_dynamic_bsz=True, max_token_len=budget))
    check_split_is_a_permutation(batch, split)
    for micro in split.micro_batches:
        tokens = int(micro[ATTENTION_MASK].sum())
        # Within budget, unless one sequence alone exceeds it (then it is alone).
        assert tokens <= budget or micro.batch_size[0] == 1
    # No fewer micro-batches than the token total forces.
    clipped_total = sum(min(length, budget) for length in lengths)
    assert len(split.micro_batches) >= math.ceil(clipped_total / budget)


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=60), data=st.data())
def test_partition_into_a_required_number_of_groups(lengths: list[int], budget: int, data) -> None:
    fewest = len(partition_by_token_budget(lengths, budget))
    num_groups = data.draw(st.integers(min_value=fewest, max_value=len(lengths)))
    groups = partition_by_token_budget(lengths, budget, num_groups=num_groups)
    assert len(groups) == num_groups
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(group for group in groups)
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)


def test_partition_is_balanced() -> None:
    # 8 sequences of 10 tokens with room for 40 per group: two groups of exactly 40.
    groups = partition_by_token_budget([10] * 8, budget=40)
    assert sorted(len(g) for g in groups) == [4, 4]
    # Longest first, into the least-loaded group: loads 25+5+... stay within one item of each other.
    lengths = [25, 20, 15, 10, 5, 5]
    loads = sorted(sum(lengths[i] for i in g) for g in partition_by_token_budget(lengths, budget=40))
    assert loads == [40, 40]


def test_select_rows_shares_the_tensors_only_for_every_row_in_order() -> None:
    batch = make_batch([3, 5, 2])
    whole = select_rows(batch, torch.arange(3))
    assert whole[INPUT_IDS].data_ptr() == batch[INPUT_IDS].data_ptr()
    whole[ATTENTION_MASK] = torch.zeros_like(whole[ATTENTION_MASK])  # a shallow copy: the batch keeps its own
    assert int(batch[ATTENTION_MASK].sum()) == 10
    for index in ([2, 1, 0], [0, 2], [0, 1, 2, 2]):
        part = select_rows(batch, torch.tensor(index))
        assert torch.equal(part[INPUT_IDS], batch[INPUT_IDS][index])
        assert part[INPUT_IDS].data_ptr() != batch[INPUT_IDS].data_ptr()


def test_more_micro_batches_than_sequences_names_the_fix() -> None:
    with pytest.raises(ValueError, match="more groups|between 1 and 3"):
        partition_by_token_budget([1, 2, 3], budget=10, num_groups=4)
    with pytest.raises(ValueError, match="cannot split an empty batch"):
        split_micro_batches(make_batch([]), MicroBatchConfig())


@settings(max_examples=40, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=60), data=st.data())
def test_fallback_when_longest_first_misses_the_budget(lengths: list[int], budget: int, data) -> None:
    """Longest-first is not guaranteed to fit with more groups; then the fewest-group partition is
    split instead. Force that path by making longest-first fail for the requested count."""
    fewest = len(partition_by_token_budget(lengths, budget))
    # With exactly the fewest groups, longest-first is the only partition there is.
    assume(fewest < len(lengths))
    num_groups = data.draw(st.integers(min_value=fewest + 1, max_value=len(lengths)))
    real = microbatch._longest_first

    def failing_for_the_requested_count(lengths_, count, labels=None):
        return None if labels is None and count == num_groups else real(lengths_, count, labels)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(microbatch, "_longest_first", failing_for_the_requested_count)
        groups = partition_by_token_budget(lengths, budget, num_groups=num_groups)
    assert len(groups) == num_groups and all(groups)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)


@st.composite
def grouped_batch(draw):
    """GRPO-style rows (groups of samples of one prompt, rows of groups interleaved or not)."""
    prompts, responses = [], []
    for group in range(draw(st.integers(1, 5))):
        prompt = [group + 1] * draw(st.integers(1, 12))  # a distinct prompt per group
        for _ in range(draw(st.integers(1, 5))):
            prompts.append(prompt)
            responses.append([7] * draw(st.integers(1, 10)))
    order = draw(st.permutations(range(len(prompts))))
    rows = [(prompts[i], responses[i]) for i in order]
    return responses_batch(
        [p for p, _ in rows], [r for _, r in rows], [[0.0] * len(r) for _, r in rows], 0
    ), rows


@settings(max_examples=80, deadline=None)
@given(grouped=grouped_batch(), budget=st.integers(4, 60), share=st.booleans())
def test_a_token_budget_keeps_the_samples_of_a_prompt_together_and_counts_it_once(
    grouped, budget, share
) -> None:
    """Sharing prompts, a micro-batch computes each of its prompts once, then its responses: the budget
    counts that, and a group that fits it stays in one micro-batch. Without sharing, every row's tokens."""
    batch, rows = grouped
    config = MicroBatchConfig(use_dynamic_bsz=True, max_token_len=budget, share_prompts=share)
    split = split_micro_batches(batch, config)
    assert sorted(torch.cat(split.indices).tolist()) == list(range(len(rows)))

    def computed(index: list[int]) -> int:  # the tokens a packed micro-batch of these rows runs
        if not share:
            return sum(len(rows[i][0]) + len(rows[i][1]) for i in index)
        prompts = {tuple(rows[i][0]) for i in index}
        return sum(len(p) for p in prompts) + sum(len(rows[i][1]) for i in index)

    for index in split.indices:  # over the budget only a row that is alone
        assert computed(index.tolist()) <= budget or len(index) == 1, (
            index,
            computed(index.tolist()),
            budget,
        )
    if share:
        home = {}
        for number, index in enumerate(split.indices):
            for i in index.tolist():
                home.setdefault(tuple(rows[i][0]), set()).add(number)
        for prompt, numbers in home.items():
            members = [i for i, (p, _) in enumerate(rows) if tuple(p) == prompt]
            if len(prompt) + sum(len(rows[i][1]) for i in members) <= budget:
                assert len(numbers) == 1, (prompt, numbers)


@settings(max_examples=60, deadline=None)
@given(grouped=grouped_batch(), data=st.data())
def test_groups_split_into_as_many_units_as_another_rank_needs_keeping_every_row(grouped, data) -> None:
    batch, rows = grouped
    units = budget_units(
        batch, MicroBatchConfig(use_dynamic_bsz=True, max_token_len=1000, share_prompts=True)
    )
    assert len(units) == len({tuple(p) for p, _ in rows})  # a budget this large: a unit per prompt
    count = data.draw(st.integers(len(units), len(rows)))
    split = at_least(units, count)
    assert len(split) >= count
    assert sorted(row for unit in split for row in unit.rows) == list(range(len(rows)))
    for unit in split:  # each piece: one prompt, once, and its rows' responses
        assert len({tuple(rows[i][0]) for i in unit.rows}) == 1
        assert unit.tokens == len(rows[unit.rows[0]][0]) + sum(len(rows[i][1]) for i in unit.rows)
