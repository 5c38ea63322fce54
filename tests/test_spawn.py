"""``verl_core.testing.spawn``: ranks in one gloo group, and every way a rank can go wrong reported
with the reason (a traceback, an exit code, the stacks of a hang), never a hang of the test; and no
process of a run outlives it, whether it passes, fails, crashes or times out, or its launcher is
killed: each run's ranks start processes that would outlive them (``fixtures.descendants``), and
the tests look for any left behind."""

from __future__ import annotations

import multiprocessing.resource_tracker
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fixtures.descendants import (
    DESCENDANTS_PER_RANK,
    MARKER,
    descendants_file,
    hangs_with_descendants,
    kill_left_behind,
    left_behind,
    start_descendants,
)

from verl_core.testing.spawn import Rank, SpawnError, _first_failures, spawn

pytestmark = pytest.mark.distributed


def sums_ranks(rank: Rank, expected: int) -> None:
    start_descendants(rank)
    value = torch.tensor([rank.rank + 1])
    dist.all_reduce(value)
    assert int(value) == expected, int(value)
    print(f"rank {rank.rank} of {rank.world_size} summed {int(value)}")


def raises_on_rank_one(rank: Rank) -> None:
    start_descendants(rank)
    dist.barrier()  # both ranks have started theirs
    if rank.rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits for rank 1, which never comes: it must be killed, not awaited


def exits_hard(rank: Rank) -> None:
    start_descendants(rank)
    os._exit(3)


@pytest.fixture
def marker(monkeypatch) -> str:
    """Tags the processes the test starts (``fixtures.descendants``); afterwards kills any that the
    test found left (so that a failure does not leave them to the next tests)."""
    # The launcher's own resource tracker, shared by all its runs and ending with it, is not a run's.
    multiprocessing.resource_tracker.ensure_running()
    value = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, value)
    yield value
    kill_left_behind(value)


def assert_nothing_left(marker: str, workdir: Path, ranks: range) -> None:
    for rank in ranks:  # the ranks did start what would outlive them
        assert len(descendants_file(workdir, rank).read_text().split()) >= DESCENDANTS_PER_RANK
    assert left_behind(marker) == []


def test_ranks_form_one_group_and_log_to_their_files(tmp_path, marker) -> None:
    spawn(sums_ranks, (3,), world_size=2, workdir=tmp_path, timeout_s=120)
    assert "rank 1 of 2 summed 3" in (tmp_path / "rank1.log").read_text()
    assert_nothing_left(marker, tmp_path, range(2))


def test_a_rank_that_raises_is_reported_with_its_traceback_and_the_others_killed(tmp_path, marker) -> None:
    with pytest.raises(SpawnError) as caught:
        spawn(raises_on_rank_one, world_size=2, workdir=tmp_path, timeout_s=120)
    # Killed at once, not at the run's timeout: rank 0 never dumped its stacks (3 s before it).
    assert "Timeout (" not in (tmp_path / "rank0.log").read_text()
    assert_nothing_left(marker, tmp_path, range(2))
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


def test_a_rank_that_exits_without_a_traceback_is_named_with_its_exit_code(tmp_path, marker) -> None:
    with pytest.raises(SpawnError, match=r"rank\(s\) \[0\] failed \(rank 0: exit code 3\)"):
        spawn(exits_hard, world_size=1, workdir=tmp_path, timeout_s=120)
    assert_nothing_left(marker, tmp_path, range(1))


def aborts_deep_in_a_stack(rank: Rank, depth: int = 80) -> None:
    """A native library's fatal error in a forward pass: its message, then an abort, under many frames."""
    if depth:
        return aborts_deep_in_a_stack(rank, depth - 1)
    print("noise " * 2000, flush=True)
    sys.stderr.write("terminate called after throwing an instance of 'gloo::IoException'\n")
    sys.stderr.write("  what():  [simulated] Connection closed by peer\n")
    sys.stderr.flush()
    os.abort()


def test_a_crash_is_reported_with_what_caused_it_not_only_its_last_frames(tmp_path) -> None:
    """faulthandler writes the innermost frames first: the report keeps the crash's start and the
    native message before it, however long the stack."""
    with pytest.raises(SpawnError) as error:
        spawn(aborts_deep_in_a_stack, world_size=1, workdir=tmp_path, timeout_s=120)
    message = str(error.value)
    assert "exit code -6" in message
    assert "what():  [simulated] Connection closed by peer" in message
    assert "Fatal Python error: Aborted" in message
    assert "aborts_deep_in_a_stack" in message


#: The timeouts the hang is tried with, in turn. The rank dumps its stacks 3 s before the timeout, and
#: must have imported torch, joined the group and reached the hang by then: seconds on a quiet machine,
#: over 20 s on one loaded by other jobs (8 s once did not do, in CI; 20 s did not under a load of 10).
#: A try that ends before the rank has reached the hang is made again with the next timeout, so that
#: what times out is the hang, on a quiet machine soon.
HANG_TIMEOUTS_S = (12, 40, 120)


def hang_until_reached(
    function: Callable[[Rank], None],
    world_size: int,
    tmp_path: Path,
    reached: Callable[[SpawnError, Path], bool],
) -> tuple[SpawnError, Path, int]:
    """Run ``function`` with each of ``HANG_TIMEOUTS_S`` in turn until its timeout shows the hang
    ``reached``; the last try's error, its workdir and its timeout."""
    for attempt, timeout_s in enumerate(HANG_TIMEOUTS_S):
        workdir = tmp_path / f"try{attempt}"
        with pytest.raises(SpawnError) as caught:
            spawn(function, world_size=world_size, workdir=workdir, timeout_s=timeout_s)
        if reached(caught.value, workdir):
            break
    return caught.value, workdir, timeout_s


def test_a_hang_ends_at_the_timeout_with_the_ranks_stacks(tmp_path, marker) -> None:
    # The rank ignores SIGTERM, as do the children it starts.
    error, workdir, timeout_s = hang_until_reached(
        hangs_with_descendants,
        1,
        tmp_path,
        # faulthandler's stacks, just before the timeout, and the rank's descendants started
        lambda error, workdir: (
            "in hangs_with_descendants" in str(error) and descendants_file(workdir, 0).exists()
        ),
    )
    assert error.timed_out and f"did not finish within {timeout_s} s" in str(error)
    assert "in hangs_with_descendants" in str(error)
    assert_nothing_left(marker, workdir, range(1))


def waits_for_a_step_rank_one_skipped(rank: Rank) -> None:
    """Rank 1 skips a step (an exception it caught and went on from) and finishes; rank 0 waits for
    it there (a key of the store stands in for the collective)."""
    if rank.rank == 1:
        print("rank 1 skipped the step: the reason it gave", file=sys.stderr)
        return
    rank.store.wait(["the skipped step"], timedelta(seconds=600))


def test_a_hang_behind_a_finished_rank_names_it_and_carries_its_log(tmp_path) -> None:
    """The rank that finished is where the reason is (what it skipped), not the one left waiting."""
    error, _, _ = hang_until_reached(
        waits_for_a_step_rank_one_skipped,
        2,
        tmp_path,
        lambda error, _: "had finished" in str(error),  # rank 1 got there before the timeout
    )
    message = str(error)
    assert error.unfinished == [0] and not error.failed
    assert "rank(s) [1] had finished: the others may wait in a collective that these never joined" in message
    assert "rank 1 skipped the step: the reason it gave" in message
    assert "in waits_for_a_step_rank_one_skipped" in message  # rank 0's stacks, where it waits


LAUNCHER = """
import sys
sys.path.insert(0, {tests!r})
from fixtures.descendants import hangs_with_descendants
from verl_core.testing.spawn import spawn
spawn(hangs_with_descendants, world_size=1, workdir={workdir!r}, timeout_s=600)
"""


def test_a_killed_launcher_takes_its_ranks_and_what_they_started_along(tmp_path, marker) -> None:
    """The launcher SIGKILLed mid-run (CI giving up on a job): its watchdog kills the ranks' groups."""
    code = LAUNCHER.format(tests=str(Path(__file__).parent), workdir=str(tmp_path))
    launcher = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while not descendants_file(tmp_path, 0).exists():  # the rank has started its descendants
        assert launcher.poll() is None, f"the launcher ended first, with exit code {launcher.returncode}"
        assert time.monotonic() < deadline, "the rank did not start its descendants within 120 s"
        time.sleep(0.1)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10  # SIGKILL is not instant; the watchdog acts within milliseconds
    while left_behind(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert_nothing_left(marker, tmp_path, range(1))


def test_local_functions_are_refused(tmp_path) -> None:
    def local(rank: Rank) -> None: ...

    with pytest.raises(ValueError, match="is a local function: spawn needs a module-level one"):
        spawn(local, world_size=1, workdir=tmp_path / "unused", timeout_s=1)  # not a folder in the checkout
