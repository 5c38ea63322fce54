"""Dispatch by topology: DP shards balanced by length, results back in batch order, and the errors a
layout or a batch size that cannot work gets. Generation and per-row forward passes take any number of
rows at any DP size (in-process ranks laid out as a DP x tensor-parallel group, against the undivided
computation); an update's equal shards are refused at the key its caller names."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from fixtures.rollouts import answered
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from verl_core.data.batch import (
    RESPONSE_MASK,
    RESPONSES,
)
from verl_core.engine import Topology, check_topologies
from verl_core.errors import ConfigError
from verl_core.rollout.base import SamplingParams
from verl_core.workers.dispatch import (
    balanced_shards,
    check_divisible,
    filled_rows,
    gather_outputs,
    restore_order,
    shards_for_ranks,
    split_batch,
)
from verl_core.workers.group import WorkerGroup
from verl_core.workers.roles import Actor


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=40), dp_size=st.integers(1, 4))
def test_shards_cover_every_row_once_with_equal_counts_and_restore_the_order(lengths, dp_size) -> None:
    lengths = lengths[: len(lengths) - len(lengths) % dp_size] or [1] * dp_size
    shards = balanced_shards(lengths, dp_size)
    assert sorted(torch.cat(shards).tolist()) == list(range(len(lengths)))
    assert {len(shard) for shard in shards} == {len(lengths) // dp_size}
    loads = [sum(lengths[i] for i in shard.tolist()) for shard in shards]
    # The snake order keeps the heaviest shard within one longest sequence of the lightest.
    assert max(loads) - min(loads) <= max(lengths)
    values = torch.tensor(lengths, dtype=torch.float32)
    parts = [values[shard] * 2 for shard in shards]  # a per-row result computed shard by shard
    torch.testing.assert_close(restore_order(parts, shards), values * 2)


def test_an_update_batch_that_does_not_split_over_the_dp_ranks_names_the_callers_key() -> None:
    batch = TensorDict({"attention_mask": torch.ones(9, 3, dtype=torch.int64)}, batch_size=[9])
    with pytest.raises(ConfigError) as raised:
        split_batch(batch, 2, "actor.ppo_mini_batch_size")
    ((key, message),) = raised.value.errors
    assert key == "actor.ppo_mini_batch_size"
    assert message.startswith("9 rows cannot be split evenly over 2 data-parallel ranks")
    with pytest.raises(ValueError, match="9 rows do not make 2 equal shards"):  # callers refuse or fill first
        balanced_shards([3] * 9, 2)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 64), min_size=1, max_size=4), dp_size=st.integers(1, 8))
def test_every_count_that_does_not_divide_is_named_and_no_other(counts, dp_size) -> None:
    keys = {f"section.key_{i}": (count, f"{count} things") for i, count in enumerate(counts)}
    refused = [key for key, (count, _) in keys.items() if count % dp_size != 0]  # the rule written out
    if not refused:
        check_divisible(keys, dp_size)
        return
    with pytest.raises(ConfigError) as raised:
        check_divisible(keys, dp_size)
    assert [key for key, _ in raised.value.errors] == refused
    for key, message in raised.value.errors:
        assert message.startswith(f"{keys[key][1]} cannot be split evenly over {dp_size} data-parallel ranks")
        assert message.endswith(f"make it a multiple of {dp_size}")


def test_outputs_come_from_one_output_rank_per_dp_rank() -> None:
    # 2 DP ranks x 2 tensor-parallel ranks: every rank of a DP group gets its shard, one of them answers.
    topologies = [Topology(0, 2, True), Topology(0, 2, False), Topology(1, 2, True), Topology(1, 2, False)]
    assert check_topologies(topologies, "actor") == 2
    assert shards_for_ranks(["a", "b"], topologies) == ["a", "a", "b", "b"]
    assert gather_outputs(["r0", None, "r1", None], topologies) == ["r0", "r1"]
    with pytest.raises(RuntimeError, match=r"exactly one output rank per data-parallel rank"):
        check_topologies([Topology(0, 2, True), Topology(1, 2, False)], "critic")
    with pytest.raises(RuntimeError, match="disagree on their data-parallel size"):
        check_topologies([Topology(0, 2, True), Topology(0, 1, True)], "actor")


# -- any number of rows: in-process ranks of a DP x tensor-parallel layout ----------------------------

SAMPLING = SamplingParams(max_new_tokens=8, eos_token_ids=(1,), pad_token_id=0)


class PromptFunctionRollout:
    """Answers each prompt with a function of its ids alone (length 1 to 5, log-probs from the ids),
    whatever else is in the batch: the undivided generation is this rollout over every prompt at once."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], int]] = []

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        assert prompts, "a rollout was asked for no prompts"
        self.calls.append(([list(prompt) for prompt in prompts], seed))
        answers = [
            [(3 * token + i) % 50 + 2 for i, token in enumerate(prompt)][: 1 + sum(prompt) % 5]
            for prompt in prompts
        ]
        return answered(prompts, answers, sampling.pad_token_id)


class Rank:
    """One in-process rank: its place in the layout, a rollout, and a per-row forward pass whose
    shard sizes it records (the ranks of a DP group must run equal, non-empty shards)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.rollout = PromptFunctionRollout()
        self.rollout_sleeps = False  # as ActorWorker's, for its generate
        self.forward_rows: list[int] = []

    def initialize(self) -> Topology:
        return self.topology

    def per_row(self, batch: TensorDict) -> torch.Tensor | None:
        self.forward_rows.append(batch.batch_size[0])
        values = (batch[RESPONSES] * 7 + batch[RESPONSE_MASK]).float().cumsum(dim=-1)
        return values if self.topology.is_output_rank else None


class Ranks(WorkerGroup):
    """``dp_size x tp_size`` ranks in this process, DP-major (ranks of one DP group side by side, the
    first of them its output rank), called in turn."""

    role = "actor"

    def __init__(self, dp_size: int, tp_size: int) -> None:
        self.world_size = dp_size * tp_size
        self.ranks = [Rank(Topology(r // tp_size, dp_size, r % tp_size == 0)) for r in range(self.world_size)]

    def call(self, method, *args, **kwargs) -> list:
        return [method(rank, *args, **kwargs) for rank in self.ranks]

    def call_each(self, method, args_per_rank) -> list:
        return [method(rank, *args) for rank, args in zip(self.ranks, args_per_rank, strict=True)]

    def shutdown(self) -> None:
        pass


class RowActor(Actor):
    worker_class = Rank


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(2, 40), min_size=1, max_size=6), min_size=1, max_size=13),
    dp_size=st.integers(1, 4),
    tp_size=st.integers(1, 2),
)
def test_generation_and_per_row_passes_take_any_row_count_as_the_undivided_computation(
    prompts, dp_size, tp_size
) -> None:
    group = Ranks(dp_size, tp_size)
    actor = RowActor(group)
    undivided = PromptFunctionRollout().generate(prompts, SAMPLING, seed=0)

    generated = actor.generate(prompts, SAMPLING, seed=7)
    assert set(generated.keys()) == set(undivided.keys())
    for key in undivided.keys():
        assert torch.equal(generated[key], undivided[key]), key
    calls = [rank.rollout.calls for rank in group.ranks]
    for dp in range(dp_size):  # a DP group's ranks all generate its share, with one seed
        assert all(calls[dp * tp_size + tp] == calls[dp * tp_size] for tp in range(tp_size))
    shares = [len(calls[dp * tp_size][0][0]) if calls[dp * tp_size] else 0 for dp in range(dp_size)]
    assert sum(shares) == len(prompts) and max(shares) - min(shares) <= 1
    assert all(len(call) <= 1 for call in calls)  # a rank with no share never asks its rollout
    seeds = [calls[dp * tp_size][0][1] for dp in range(dp_size) if shares[dp]]
    assert len(set(seeds)) == len(seeds)  # each DP rank samples its own stream

    per_row = actor._per_row(Rank.per_row, undivided)
    torch.testing.assert_close(per_row, Rank.per_row(Rank(Topology(0, 1, True)), undivided), rtol=0, atol=0)
    # Every rank ran one forward pass, all of the same non-empty size: their collectives line up.
    assert {tuple(rank.forward_rows) for rank in group.ranks} == {(-(-len(prompts) // dp_size),)}


def test_filled_rows_are_the_batch_then_copies_of_its_first_rows() -> None:
    assert filled_rows(5, 2).tolist() == [0, 1, 2, 3, 4, 0]
    assert filled_rows(1, 4).tolist() == [0, 0, 0, 0]
    assert filled_rows(6, 3).tolist() == list(range(6))
    with pytest.raises(ValueError, match="at least one row"):
        filled_rows(0, 2)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 8),
    group_size=st.integers(1, 8),
    dp_size=st.integers(1, 4),
    data=st.data(),
)
def test_the_samples_of_a_prompt_go_to_one_rank_when_the_groups_divide(
    groups, group_size, dp_size, data
) -> None:
    """GRPO's groups (one size, a count the DP size divides) stay whole on one rank, the shards equal;
    any other grouping is balanced row by row, as without groups."""
    rows = groups * group_size
    if rows % dp_size:
        return
    lengths = data.draw(st.lists(st.integers(1, 100), min_size=rows, max_size=rows))
    uid = [row // group_size for row in range(rows)]
    shards = balanced_shards(lengths, dp_size, uid)
    assert sorted(torch.cat(shards).tolist()) == list(range(rows))
    assert {len(shard) for shard in shards} == {rows // dp_size}
    owners: dict[int, set[int]] = {}
    for rank, shard in enumerate(shards):
        for row in shard.tolist():
            owners.setdefault(uid[row], set()).add(rank)
    if groups % dp_size == 0:
        assert all(len(ranks) == 1 for ranks in owners.values()), owners
        loads = [sum(lengths[i] for i in shard.tolist()) for shard in shards]
        heaviest_group = max(
            sum(lengths[r] for r in range(g * group_size, (g + 1) * group_size)) for g in range(groups)
        )
        assert max(loads) - min(loads) <= heaviest_group
    else:
        assert [shard.tolist() for shard in shards] == [
            shard.tolist() for shard in balanced_shards(lengths, dp_size)
        ]
