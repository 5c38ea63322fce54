"""Dispatch by topology: DP shards balanced by length, results back in batch order, and the errors a
layout or a batch size that cannot work gets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.engine import Topology, check_topologies
from verl_core.errors import ConfigError
from verl_core.workers.dispatch import (
    balanced_shards,
    check_divisible,
    gather_outputs,
    restore_order,
    shards_for_ranks,
)


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


def test_a_batch_that_does_not_split_over_the_dp_ranks_names_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"data\.train_batch_size: 9 sequences cannot be split evenly over 2"
    ):
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
