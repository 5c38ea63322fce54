"""Run a function on several processes that form one ``torch.distributed`` group, for tests.

``spawn(function, args, world_size=2, workdir=..., timeout_s=...)`` starts one process per rank
(gloo on CPU, NCCL on CUDA, rendezvous through a file store in ``workdir``, so no port can collide),
calls ``function(rank, *args)`` in each with a ``Rank`` describing its place, and returns once every
rank has finished. It is built so that a distributed test can fail but never hang or fail silently:

- the whole run has a hard timeout; shortly before it, every rank dumps its Python stacks;
- each rank's stdout, stderr, traceback and (on a crash) ``faulthandler`` stacks go to
  ``workdir/rank<N>.log``, and a failure's ``SpawnError`` carries the tail of every failed or
  unfinished rank's log, so the reason is in the test report, not only an exit code;
- a rank that raises makes the others be killed at once (they may wait in a collective it never
  joins); a rank that fails because another one did (its collective saw the peer leave) is told
  apart from the one that failed first, by when each failed;
- a timeout while some ranks had finished names them and carries their logs too: the others may
  wait in a collective that these skipped (an exception that one rank caught and went on from);
- the ranks run under the caller's warning filters (``-W error``, a test's ``filterwarnings`` marks), so
  a test that turns warnings into errors does so in its ranks too;
- ranks leave with ``os._exit`` after destroying the process group: torch 2.13 can deadlock when
  Python frees a DDP reducer that holds the last reference to a gloo group at interpreter exit
  (the group's destructor joins a worker thread that waits for the GIL);
- no process of a run outlives it, whatever its ranks do. Each rank leads a session of its own, so
  that what it starts (a ``multiprocessing`` resource tracker or manager, megatron-core's checkpoint
  writers, ``torch.compile`` workers) is in its process group, orphaned or not; when the run ends,
  passed, failed, crashed or timed out, the launcher kills every rank's group with SIGKILL (not a
  request to exit) and returns once none of their processes is left. If the launcher dies first
  (killed by CI, say), a watchdog process, in a session of its own, kills the groups when the
  launcher's end of its pipe closes. A descendant that leaves the rank's session (a daemon that
  calls ``setsid`` itself) is beyond this reach.

``function`` must be importable by name in a fresh process, or defined in a file that is (a test
module loaded by pytest's ``importlib`` mode is found through its file).
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing
import os
import pickle
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import attrs

from verl_core.testing.reaping import Watchdog, end_processes, read_exit_codes

#: How long one collective may wait for the other ranks before it fails.
COLLECTIVE_TIMEOUT_S = 60.0
#: How much of a failed or unfinished rank's log a ``SpawnError`` carries.
LOG_TAIL_CHARS = 4000


class SpawnError(RuntimeError):
    """A rank failed or the run timed out. ``failed`` lists the ranks that failed first,
    ``failed_after`` those that failed later (typically in a collective the first ones left),
    ``unfinished`` those still running at the timeout; the message holds the tail of each one's log
    (its traceback, or its stacks at the timeout)."""

    def __init__(
        self,
        message: str,
        failed: Sequence[int] = (),
        unfinished: Sequence[int] = (),
        failed_after: Sequence[int] = (),
    ):
        super().__init__(message)
        self.failed = list(failed)
        self.failed_after = list(failed_after)
        self.unfinished = list(unfinished)

    @property
    def timed_out(self) -> bool:
        return bool(self.unfinished)


@attrs.frozen
class Rank:
    """What a spawned function learns about its place: the process group is already initialised."""

    rank: int
    world_size: int
    #: The rendezvous store, for coordination outside collectives (``store.set`` / ``store.wait``).
    store: Any
    workdir: Path
    #: ``cpu``, or ``cuda`` (then the current CUDA device is ``rank % device_count``).
    device: str


@attrs.frozen
class ModuleRef:
    """A module for a fresh process: imported by ``name``, or, when that name is not importable
    there (a test module under pytest's ``importlib`` import mode), loaded from ``file``."""

    name: str
    file: str | None = None

    @classmethod
    def of(cls, module: str | types.ModuleType) -> ModuleRef:
        if isinstance(module, str):
            return cls(module)
        if module.__name__ == "__main__":
            raise ValueError(
                "module __main__ cannot be imported by the spawned ranks: move what they need (hook "
                "implementations, the function to run) into an importable module and pass that"
            )
        return cls(module.__name__, getattr(module, "__file__", None))

    def importable(self) -> bool:
        try:
            return importlib.util.find_spec(self.name) is not None
        except (ImportError, ValueError):  # a parent package that does not exist either
            return False

    def load(self) -> types.ModuleType:
        if self.name in sys.modules:
            return sys.modules[self.name]
        if self.file is None or self.importable():
            return importlib.import_module(self.name)
        spec = importlib.util.spec_from_file_location(self.name, self.file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.name] = module  # so that "name:attribute" import strings resolve
        spec.loader.exec_module(module)
        return module


@attrs.frozen
class FunctionRef:
    """A module-level function, by module and name, for a fresh process."""

    module: ModuleRef
    name: str

    @classmethod
    def of(cls, function: Callable[..., Any]) -> FunctionRef:
        if "<locals>" in function.__qualname__:
            raise ValueError(f"{function.__qualname__} is a local function: spawn needs a module-level one")
        # By its code's file, too: a module loaded by path need not be in sys.modules.
        module = ModuleRef.of(function.__module__)
        return cls(ModuleRef(module.name, function.__code__.co_filename), function.__qualname__)

    def load(self) -> Callable[..., Any]:
        return getattr(self.module.load(), self.name)


def log_path(workdir: str | os.PathLike, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.log"


def spawn(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    world_size: int,
    workdir: str | os.PathLike,
    timeout_s: float,
    device: str = "cpu",
    backend: str | None = None,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> None:
    """Run ``function(rank: Rank, *args)`` on ``world_size`` processes; raise ``SpawnError`` if a rank
    fails or the run exceeds ``timeout_s`` (see the module docstring). ``workdir`` must be empty of
    an earlier run's store (use a fresh folder per run). ``backend`` is the process group's (default:
    gloo on the CPU, NCCL on CUDA; ``"cpu:gloo,cuda:nccl"`` for both)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    target = FunctionRef.of(function)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_rank_main,
            args=(
                rank,
                world_size,
                target,
                tuple(args),
                str(workdir),
                device,
                backend,
                timeout_s,
                collective_timeout_s,
                _picklable_warning_filters(),
            ),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    # Exit codes are read without reaping the ranks (see reaping.exit_code): while a rank is unreaped, its
    # pid, which is also its group's id, cannot be given to another process, so killing that group
    # at the end cannot hit a stranger.
    exit_codes: dict[int, int] = {}
    watchdog = Watchdog()
    try:
        for process in processes:
            process.start()
            watchdog.watch(process.pid)
        deadline = time.monotonic() + timeout_s
        while True:
            read_exit_codes(processes, exit_codes)
            if len(exit_codes) == world_size or any(exit_codes.values()):
                break  # done, or a rank failed: the others may be waiting for it in a collective
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            running = [p.sentinel for rank, p in enumerate(processes) if rank not in exit_codes]
            wait(running, timeout=min(remaining, 1.0))
    finally:
        read_exit_codes(processes, exit_codes)
        unfinished = [rank for rank in range(world_size) if rank not in exit_codes]
        end_processes(processes)
        watchdog.release()
    failed = [rank for rank, code in sorted(exit_codes.items()) if code != 0]
    if not failed and not unfinished:
        return
    failed, failed_after = _first_failures(workdir, failed)

    def codes(ranks: list[int]) -> str:
        return ", ".join(f"rank {rank}: exit code {exit_codes[rank]}" for rank in ranks)

    problems = []
    if failed:
        problems.append(f"rank(s) {failed} failed ({codes(failed)})")
    if failed_after:
        problems.append(f"rank(s) {failed_after} failed after another rank failed ({codes(failed_after)})")
    # A timeout with ranks that finished: the others may wait in a collective those never joined (a
    # step that one rank skipped, an exception caught on it alone), which their logs may say.
    finished = (
        [rank for rank, code in sorted(exit_codes.items()) if code == 0] if unfinished and not failed else []
    )
    if unfinished:
        reason = (
            "were killed after another rank failed" if failed else f"did not finish within {timeout_s:.0f} s"
        )
        problems.append(f"rank(s) {unfinished} {reason}")
    if finished:
        problems.append(
            f"rank(s) {finished} had finished: the others may wait in a collective that these never joined"
        )
    tails = "\n".join(
        f"--- rank {rank} ({log_path(workdir, rank)}):\n{_tail(log_path(workdir, rank))}"
        for rank in failed + failed_after + unfinished + finished
    )
    raise SpawnError(
        f"{'; '.join(problems)}\n{tails}", failed, unfinished if not failed else [], failed_after
    )


def _failure_time_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank{rank}.failed_at"


def _first_failures(workdir: Path, failed: list[int]) -> tuple[list[int], list[int]]:
    """``failed`` split into the ranks that failed first and those that failed after them, by the
    monotonic clock each rank read as it failed. A rank that died without reading it (killed by a
    signal, ``os._exit``) counts as failing first: nothing says otherwise."""
    times = {}
    for rank in failed:
        try:
            times[rank] = int(_failure_time_path(workdir, rank).read_text())
        except (OSError, ValueError):
            pass
    if not times:
        return failed, []
    first = min(times.values())
    after = [rank for rank in failed if times.get(rank, first) > first]
    return [rank for rank in failed if rank not in after], after


def _picklable_warning_filters() -> list[tuple[Any, ...]]:
    """The caller's warning filters, for the ranks; one whose category cannot reach another process (a
    class local to a test) is left out."""
    kept = []
    for entry in warnings.filters:
        try:
            pickle.dumps(entry)
        except Exception:
            continue
        kept.append(entry)
    return kept


def _install_warning_filters(filters: list[tuple[Any, ...]]) -> None:
    warnings.resetwarnings()
    for action, message, category, module, lineno in reversed(filters):  # each goes to the front
        # Patterns are compiled, or plain strings in Python's own defaults.
        message, module = (getattr(part, "pattern", part) or "" for part in (message, module))
        warnings.filterwarnings(action, message, category, module, lineno)


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log: the process died before it started)"
    if not text.strip():
        return "(empty log)"
    crash = text.find("Fatal Python error")
    if crash >= 0:
        # faulthandler's report of a crash lists the innermost frames first, and what a C++ library
        # printed just before it (an uncaught exception's what()) says why: keep those, not the tail.
        start = max(0, crash - LOG_TAIL_CHARS // 4)
        return ("..." if start else "") + text[start : start + LOG_TAIL_CHARS]
    return text[-LOG_TAIL_CHARS:]


def _rank_main(
    rank: int,
    world_size: int,
    target: FunctionRef,
    args: tuple[Any, ...],
    workdir: str,
    device: str,
    backend: str | None,
    timeout_s: float,
    collective_timeout_s: float,
    warning_filters: list[tuple[Any, ...]],
) -> None:
    """One rank: log to a file, join the group, run the function, leave without interpreter teardown."""
    # First of all, before this rank starts any process: a session (and process group) of its own,
    # which the launcher kills whole when the run ends.
    os.setsid()
    _install_warning_filters(warning_filters)
    log = open(log_path(workdir, rank), "a", buffering=1)  # noqa: SIM115 (open until os._exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log)
    # Stacks just before the parent gives up, so that a hang shows where each rank waits.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 3.0), file=log)
    code = 1
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # ranks share few cores: oversubscription is ~100x slower
        if device.startswith("cuda"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
        store = dist.FileStore(str(Path(workdir) / "store"), world_size)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        target.load()(Rank(rank, world_size, store, Path(workdir), device), *args)
        dist.destroy_process_group()
        code = 0
    except BaseException:
        # Read before anything else: the moment this rank failed, to tell it apart from the ranks
        # that fail because it left (CLOCK_MONOTONIC is one clock for every process).
        failed_at = time.monotonic_ns()
        traceback.print_exc()
        _failure_time_path(Path(workdir), rank).write_text(str(failed_at))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        log.flush()
        os._exit(code)
