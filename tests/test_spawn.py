"""``verl_core.testing.spawn``: ranks in one gloo group, and every way a rank can go wrong reported
with the reason (a traceback, an exit code, the stacks of a hang), never a hang of the test."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from verl_core.testing.spawn import Rank, SpawnError, _first_failures, spawn

pytestmark = pytest.mark.distributed


def sums_ranks(rank: Rank, expected: int) -> None:
    value = torch.tensor([rank.rank + 1])
    dist.all_reduce(value)
    assert int(value) == expected, int(value)
    print(f"rank {rank.rank} of {rank.world_size} summed {int(value)}")


def raises_on_rank_one(rank: Rank) -> None:
    if rank.rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits for rank 1, which never comes: it must be killed, not awaited


def exits_hard(rank: Rank) -> None:
    os._exit(3)


def hangs(rank: Rank) -> None:
    time.sleep(600)


def test_ranks_form_one_group_and_log_to_their_files(tmp_path) -> None:
    spawn(sums_ranks, (3,), world_size=2, workdir=tmp_path, timeout_s=120)
    assert "rank 1 of 2 summed 3" in (tmp_path / "rank1.log").read_text()


def test_a_rank_that_raises_is_reported_with_its_traceback_and_the_others_killed(tmp_path) -> None:
    started = time.monotonic()
    with pytest.raises(SpawnError) as caught:
        spawn(raises_on_rank_one, world_size=2, workdir=tmp_path, timeout_s=120)
    assert time.monotonic() - started < 60  # not the 60 s collective timeout of rank 0
    message = str(caught.value)
    assert "rank(s) [1] failed (rank 1: exit code 1)" in message
    assert "ValueError: rank one cannot go on" in message and "raises_on_rank_one" in message
    # Rank 0 is killed waiting in the barrier, unless its barrier saw rank 1 leave and raised first.
    assert (
        "rank(s) [0] were killed after another rank failed" in message
        or "rank(s) [0] failed after another rank failed (rank 0: exit code 1)" in message
    )
    assert caught.value.failed == [1] and not caught.value.timed_out


def test_ranks_that_fail_later_are_told_apart_from_the_first_failure(tmp_path) -> None:
    # What the ranks record as they fail (monotonic nanoseconds); rank 3 died without recording.
    for rank, failed_at in {0: 2_000, 1: 1_000, 2: 1_000}.items():
        (tmp_path / f"rank{rank}.failed_at").write_text(str(failed_at))
    assert _first_failures(tmp_path, [0, 1, 2, 3]) == ([1, 2, 3], [0])
    assert _first_failures(tmp_path, [3]) == ([3], [])


def test_a_rank_that_exits_without_a_traceback_is_named_with_its_exit_code(tmp_path) -> None:
    with pytest.raises(SpawnError, match=r"rank\(s\) \[0\] failed \(rank 0: exit code 3\)"):
        spawn(exits_hard, world_size=1, workdir=tmp_path, timeout_s=120)


def test_a_hang_ends_at_the_timeout_with_the_ranks_stacks(tmp_path) -> None:
    # The rank dumps its stacks 3 s before the timeout: the timeout leaves the rank time to import
    # torch, join the group and reach ``hangs`` on a loaded machine (8 s once did not, in CI).
    with pytest.raises(SpawnError) as caught:
        spawn(hangs, world_size=1, workdir=tmp_path, timeout_s=20)
    assert caught.value.timed_out and "did not finish within 20 s" in str(caught.value)
    assert "in hangs" in str(caught.value)  # faulthandler's stacks, dumped just before the timeout


def test_local_functions_are_refused() -> None:
    def local(rank: Rank) -> None: ...

    with pytest.raises(ValueError, match="is a local function: spawn needs a module-level one"):
        spawn(local, world_size=1, workdir="unused", timeout_s=1)
