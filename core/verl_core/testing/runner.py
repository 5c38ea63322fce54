"""Run the conformance checks of one backend at one world size: one spawn, every check, one report.

``run_conformance`` spawns ``world_size`` processes (gloo on CPU, NCCL on CUDA) that rebuild the
plugin registry from module names (registries do not cross process boundaries), build the tiny
model, and run every requested check in order. Each rank saves its records after every check, so a
crash or a hang (the whole spawn has a hard timeout) still reports what finished and where it broke.
Checks the backend declares it fails (``expected_failed_checks``) are reported ``xfailed``, strictly.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import types
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from verl_core.testing.report import CheckOutcome, ConformanceReport, RankRecord, expected_failures, run_check
from verl_core.testing.spawn import COLLECTIVE_TIMEOUT_S, ModuleRef, Rank, SpawnError, spawn

if TYPE_CHECKING:
    from verl_core.plugins import Registry

#: Time the ranks get to exchange their check status before the run gives up on a silent rank.
STATUS_TIMEOUT_S = 2 * COLLECTIVE_TIMEOUT_S


@attrs.frozen
class ConformanceJob:
    """Everything a spawned rank needs, as plain picklable data."""

    backend: str
    world_size: int
    options: Any
    plugins: tuple[ModuleRef, ...]
    autoload: bool | None
    checks: tuple[str, ...]
    device: str
    workdir: str

    def registry(self) -> Registry:
        """The registry the user would get: built-ins, entry points (per ``autoload``), ``plugins``."""
        from verl_core.plugins import Registry

        # By name where importable (the registry imports it and reports import errors), else the module.
        plugins = [
            plugin.name if plugin.file is None or plugin.importable() else plugin.load()
            for plugin in self.plugins
        ]
        return Registry.from_plugins(plugins, autoload=self.autoload)


def run_conformance(
    backend: str,
    world_size: int = 1,
    *,
    options: Any = None,
    plugins: Sequence[str | types.ModuleType] = (),
    autoload: bool | None = None,
    checks: Sequence[str] | None = None,
    device: str = "cpu",
    timeout_s: float = 600.0,
    workdir: str | os.PathLike | None = None,
    expected_failed_checks: Mapping[str, str] | None = None,
) -> ConformanceReport:
    """Run the conformance checks of engine backend ``backend`` on ``world_size`` spawned ranks.

    ``backend`` is looked up through the plugin registry, as users' configs are: core's built-ins,
    the installed plugins' entry points (unless ``autoload`` is false; ``None`` follows
    ``VERL_CORE_DISABLE_PLUGIN_AUTOLOAD``) and ``plugins``, modules (or their importable names) of
    hook implementations. ``options`` are the backend's options: an instance of its config class, a
    mapping structured into it, or ``None`` for its defaults. ``checks`` selects checks by name
    (default: all of ``verl_core.testing.checks.CHECKS``). ``timeout_s`` bounds the whole spawn.
    ``workdir`` keeps the model, checkpoints and exports for inspection, under
    ``<workdir>/<backend>-world_size<N>`` (replaced by the next run); by default a temporary folder.
    ``expected_failed_checks`` (``{check: reason}``) are the checks the backend knowingly fails: each
    is reported ``xfailed`` with its reason when it fails or raises, and ``failed`` when it passes
    (the declaration is out of date); a name that is not a check raises ``ValueError``.
    """
    from verl_core.testing.checks import CHECKS

    selected = tuple(CHECKS) if checks is None else tuple(checks)
    unknown = [name for name in selected if name not in CHECKS]
    if unknown:
        raise ValueError(f"unknown conformance check(s) {unknown}; the checks are {list(CHECKS)}")
    expected = expected_failures(expected_failed_checks, CHECKS)
    plugin_modules = tuple(ModuleRef.of(plugin) for plugin in plugins)

    with tempfile.TemporaryDirectory(prefix="verl-conformance-") as scratch:
        # The run's own folder, emptied first: a stale store file would confuse the rendezvous.
        run_dir = Path(workdir or scratch) / f"{backend}-world_size{world_size}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        job = ConformanceJob(
            backend, world_size, options, plugin_modules, autoload, selected, device, str(run_dir)
        )
        resolve_backend(job)  # fail here, with the registry's message, rather than in every rank
        error = _spawn(job, timeout_s)
        records = [_read_records(job.workdir, rank) for rank in range(world_size)]
    outcomes = {
        name: CheckOutcome.merge(
            name, [r for rank_records in records for r in rank_records if r.check == name], world_size
        )
        for name in selected
    }
    report = ConformanceReport(backend, world_size, outcomes, error)
    return report.expecting(expected)


def resolve_backend(job: ConformanceJob) -> tuple[Any, Any, tuple[str, ...]]:
    """``(registry, options instance, roles)`` of ``job.backend``; raises the registry's or the
    config's error (unknown backend, unknown option key) naming the fix."""
    from verl_core.config import structure

    registry = job.registry()
    descriptor = registry.get("engine_backends", job.backend, where="conformance backend")
    options = job.options
    if isinstance(options, Mapping):
        options = structure(dict(options), descriptor.load_config(), "engine.options", registry=registry)
    return registry, options, tuple(descriptor.roles)


# -- the parent side --------------------------------------------------------------------------------


def _spawn(job: ConformanceJob, timeout_s: float) -> str | None:
    """Run ``job`` on its ranks; return why the run broke (a rank crashed, the timeout), or None."""
    try:
        spawn(
            _rank_main,
            (job,),
            world_size=job.world_size,
            workdir=job.workdir,
            timeout_s=timeout_s,
            device=job.device,
            collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        )
    except SpawnError as error:
        if error.timed_out:
            running = {rank: _running_check(job.workdir, rank) for rank in range(job.world_size)}
            return (
                f"the run exceeded its timeout of {timeout_s:.0f} s and was killed; checks running per rank: "
                f"{running} (raise timeout_s if the machine is just slow). {error}"
            )
        return f"a rank failed outside the checks: {error}"
    return None


def _records_path(workdir: str, rank: int) -> Path:
    return Path(workdir) / f"records_rank{rank}.pkl"


def _read_records(workdir: str, rank: int) -> list[RankRecord]:
    path = _records_path(workdir, rank)
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        return pickle.load(f)["records"]


def _running_check(workdir: str, rank: int) -> str | None:
    path = _records_path(workdir, rank)
    if not path.is_file():
        return "setup"
    with open(path, "rb") as f:
        return pickle.load(f)["running"]


# -- the rank side ----------------------------------------------------------------------------------


def _rank_main(rank: Rank, job: ConformanceJob) -> None:
    """One spawned rank: the process group is up (``verl_core.testing.spawn``); run the checks."""
    import torch

    _quiet_transformers()
    if job.device.startswith("cuda"):
        # Checkpoint and offload checks compare runs bitwise: CUDA's atomics-based kernels (the
        # embedding backward) would differ run to run. cuBLAS needs its workspace pinned for this.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    _run_checks(rank.rank, job, rank.store)


def _run_checks(rank: int, job: ConformanceJob, store: Any) -> None:
    import torch.distributed as dist

    from verl_core.testing.checks import CHECKS
    from verl_core.testing.context import RankContext
    from verl_core.testing.tiny import ModelDirs, save_tiny_models

    workdir = Path(job.workdir)
    registry, options, roles = resolve_backend(job)
    dirs = save_tiny_models(workdir / "model") if rank == 0 else ModelDirs.under(workdir / "model")
    dist.barrier()
    ctx = RankContext(
        job.backend, roles, options, registry, rank, job.world_size, job.device, dirs, workdir, store=store
    )

    records: list[RankRecord] = []
    for index, name in enumerate(job.checks):
        _save_records(job.workdir, rank, records, running=name)
        record = run_check(CHECKS[name], ctx, rank)
        records.append(record)
        _save_records(job.workdir, rank, records, running=None)
        if not _all_ranks_fine(store, name, rank, job.world_size, not record.raised):
            # A rank that raised may have left the others inside a collective it never joined;
            # the process group is no longer trustworthy, so stop here and report.
            reason = (
                f"not run: check '{name}' raised on a rank, after which the ranks cannot be trusted to agree"
            )
            records += [RankRecord(later, rank, "error", reason=reason) for later in job.checks[index + 1 :]]
            _save_records(job.workdir, rank, records, running=None)
            break


def _all_ranks_fine(
    store: Any, check: str, rank: int, world_size: int, fine: bool, timeout_s: float = STATUS_TIMEOUT_S
) -> bool:
    """Whether every rank finished ``check`` without raising (a single rank always continues).

    Goes through the store, not a collective, so it cannot be confused with a collective that a
    failing engine left pending.
    """
    if world_size == 1:
        return True
    store.set(f"status/{check}/{rank}", "ok" if fine else "error")
    keys = [f"status/{check}/{other}" for other in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:
        return False
    return all(store.get(key) == b"ok" for key in keys)


def _save_records(workdir: str, rank: int, records: list[RankRecord], running: str | None) -> None:
    path = _records_path(workdir, rank)
    partial = path.with_suffix(".tmp")
    with open(partial, "wb") as f:
        pickle.dump({"records": records, "running": running}, f)
    os.replace(partial, path)  # the parent never reads a half-written file


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
