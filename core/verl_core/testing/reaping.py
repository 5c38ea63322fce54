"""Ending every process of a spawned run: the ranks, and whatever they started (``spawn``'s promise
that no process of a run outlives it).

Each rank leads a session of its own; ``end_processes`` kills every rank's process group with
SIGKILL, reaps the ranks and waits until /proc lists no process of their sessions. Exit codes are
read without reaping (``WNOWAIT``), so that a rank's pid, which is its group's id, cannot be reused
by a stranger before its group is killed. ``Watchdog`` kills the groups if the launcher dies first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

#: How long the processes of a run's groups may take to die once killed (SIGKILL: normally ms).
KILLED_EXIT_TIMEOUT_S = 10.0


def read_exit_codes(processes: Sequence[Any], exit_codes: dict[int, int]) -> None:
    """Add the exit code of every rank that has ended since the last call to ``exit_codes``."""
    for rank, process in enumerate(processes):
        if rank not in exit_codes and process.pid is not None:
            code = exit_code(process)
            if code is not None:
                exit_codes[rank] = code


def exit_code(process: Any) -> int | None:
    """The rank's exit code (minus the signal that killed it), or None while it runs, read with
    ``WNOWAIT``: the rank stays unreaped, a zombie, until ``end_processes`` has killed its group."""
    try:
        status = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (multiprocessing reaps finished children on start())
        return process.exitcode
    if status is None:
        return None
    return status.si_status if status.si_code == os.CLD_EXITED else -status.si_status


def end_processes(processes: Sequence[Any]) -> None:
    """Kill every started rank and its process group (what it started, orphaned or not), reap the
    ranks, and wait until no process of their sessions is left."""
    started = [process for process in processes if process.pid is not None]
    for process in started:
        # The rank first: one killed before it made its own session has no group yet (nor children).
        _kill(os.kill, process.pid)
        _kill(os.killpg, process.pid)
    for process in started:
        process.join()
    _wait_until_gone({process.pid for process in started}, KILLED_EXIT_TIMEOUT_S)


def _kill(kill: Any, pid: int) -> None:
    try:
        kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # gone already, or (a group) never made


def _wait_until_gone(sessions: set[int], timeout_s: float) -> None:
    """Wait until no live process belongs to ``sessions`` (each rank's session id is its pid),
    killing the group of any that is (one forked while its group was being killed)."""
    if not sessions or not os.path.isdir("/proc"):
        return  # only Linux lists processes there; the groups were killed all the same
    deadline = time.monotonic() + timeout_s
    while True:
        left = _session_members(sessions)
        if not left:
            return
        if time.monotonic() > deadline:
            warnings.warn(
                f"processes {sorted(left)} of spawned ranks were still alive {timeout_s:.0f} s after being "
                "killed (SIGKILL)",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        for group in set(left.values()):
            _kill(os.killpg, group)
        time.sleep(0.02)


def _session_members(sessions: set[int]) -> dict[int, int]:
    """``{pid: process group}`` of the live (not zombie) processes of ``sessions``, from /proc."""
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended while being listed
        # Fields after the command name (which may hold spaces and parentheses): state, ppid,
        # process group, session.
        state, _, group, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) in sessions and state not in ("Z", "X"):
            members[int(entry)] = int(group)
    return members


#: The watchdog's program (``python -I -S -c``, so it starts in milliseconds): it reads one rank pid
#: per line; "done" means the launcher ended the run itself; the end of its input without "done"
#: means the launcher died, and it kills what the launcher could not.
_WATCHDOG = """
import os, signal, sys
pids = []
for line in sys.stdin:
    if line == "done\\n":
        sys.exit(0)
    pids.append(int(line))
for pid in pids:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class Watchdog:
    """Kills the ranks' groups if the launcher dies during the run (see the module docstring). It
    runs in a session of its own, so that a signal to the launcher's process group spares it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG],
            stdin=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )

    def watch(self, pid: int) -> None:
        self._send(f"{pid}\n")

    def release(self) -> None:
        """The launcher has ended the run itself: the watchdog exits without killing anything."""
        self._send("done\n")
        try:
            self.process.stdin.close()
        except OSError:
            pass
        self.process.wait()

    def _send(self, line: str) -> None:
        try:
            self.process.stdin.write(line)
            self.process.stdin.flush()
        except OSError:  # BrokenPipeError: someone killed the watchdog; the launcher still kills
            pass
