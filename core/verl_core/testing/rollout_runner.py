"""Run the rollout conformance checks of one rollout backend: one process, one rollout, one report.

A rollout runs on one rank and owns no process group, so nothing is spawned: the backend is looked
up through the plugin registry as ``rollout.backend`` is, built on the kit's model
(``save_rollout_model``) with the given options and initialised once, and every requested check of
``ROLLOUT_CHECKS`` runs against it in order. A check that raises is reported as ``error`` with its
traceback (``failed``, with what it saw, if a comparison had already failed) and the next one runs; a
rollout that cannot be built or initialised fails the run (``report.error``) and every check with it.
Checks the backend declares it fails (``expected_failed_checks``) are reported ``xfailed``, strictly.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_core.testing.report import CheckOutcome, ConformanceReport, RankRecord, expected_failures, run_check

if TYPE_CHECKING:
    from verl_core.testing.tiny import TinyModelSpec


def run_rollout_conformance(
    backend: str,
    *,
    options: Any = None,
    plugins: Sequence[str | types.ModuleType] = (),
    autoload: bool | None = None,
    checks: Sequence[str] | None = None,
    device: str = "cpu",
    model_dir: str | os.PathLike | None = None,
    workdir: str | os.PathLike | None = None,
    expected_failed_checks: Mapping[str, str] | None = None,
    model_spec: TinyModelSpec | None = None,
) -> ConformanceReport:
    """Run the rollout conformance checks of rollout backend ``backend`` in this process.

    ``backend`` is looked up through the plugin registry, as ``rollout.backend`` is: core's
    built-ins, the installed plugins' entry points (unless ``autoload`` is false; ``None`` follows
    ``VERL_CORE_DISABLE_PLUGIN_AUTOLOAD``) and ``plugins``, modules (or their importable names) of
    hook implementations. ``options`` are the backend's options: an instance of its config class, a
    mapping structured into it, or ``None`` for its defaults. ``checks`` selects checks by name
    (default: all of ``ROLLOUT_CHECKS``). ``device`` is where the rollout runs (the reference runs on
    the CPU). ``model_dir`` is a model written by ``save_rollout_model`` (to share one between runs);
    by default one is built under ``workdir`` (kept for inspection), or in a temporary folder, from
    ``model_spec`` (default ``TinyModelSpec()``, whose heads have 8 dimensions; an inference engine whose
    attention needs more, as vLLM's CPU backend needs 32 or more, passes a wider one).
    ``expected_failed_checks`` (``{check: reason}``) are the checks the backend knowingly fails,
    reported ``xfailed`` when they fail and ``failed`` when they pass, as for ``run_conformance``.

    The caller's global RNG state and ``transformers``' logging settings are left as they were.
    """
    import torch

    from verl_core.testing.rollout_checks import ROLLOUT_CHECKS

    selected = tuple(ROLLOUT_CHECKS) if checks is None else tuple(checks)
    unknown = [name for name in selected if name not in ROLLOUT_CHECKS]
    if unknown:
        raise ValueError(
            f"unknown rollout conformance check(s) {unknown}; the checks are {list(ROLLOUT_CHECKS)}"
        )
    expected = expected_failures(expected_failed_checks, ROLLOUT_CHECKS)
    descriptor, rollout_class, options = resolve_rollout_backend(backend, options, plugins, autoload, device)

    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with (
        tempfile.TemporaryDirectory(prefix="verl-rollout-conformance-") as scratch,
        torch.random.fork_rng(devices=devices),
        _quiet_transformers(),
    ):
        if model_dir is None:
            from verl_core.testing.rollout_checks import save_rollout_model

            model_dir = save_rollout_model(
                Path(workdir or scratch) / f"rollout-{backend}" / "model", model_spec
            )
        records, error = _run_checks(descriptor, rollout_class, options, str(model_dir), device, selected)
    outcomes = {
        name: CheckOutcome.merge(name, [record for record in records if record.check == name], 1)
        for name in selected
    }
    report = ConformanceReport(backend, 1, outcomes, error, kind="rollout")
    return report.expecting(expected)


def resolve_rollout_backend(
    backend: str,
    options: Any,
    plugins: Sequence[str | types.ModuleType],
    autoload: bool | None,
    device: str,
) -> tuple[Any, type, Any]:
    """``(descriptor, rollout class, options instance)`` of ``backend``; raises the registry's or the
    config's error (unknown backend, unknown option key), or ``ValueError`` for a device it does not list."""
    from verl_core.config import structure
    from verl_core.hookspecs import Kind
    from verl_core.plugins import Registry
    from verl_core.rollout.base import BaseRollout

    registry = Registry.from_plugins(list(plugins), autoload=autoload)
    entry = registry.entry(Kind.ROLLOUT_BACKENDS, backend, where="rollout conformance backend")
    device_type = device.split(":")[0]
    if device_type not in entry.descriptor.devices:
        raise ValueError(
            f"rollout backend '{backend}' runs on {list(entry.descriptor.devices)}, not on {device!r}"
        )
    rollout_class = entry.load("rollout")
    if not (isinstance(rollout_class, type) and issubclass(rollout_class, BaseRollout)):
        raise TypeError(
            f"rollout backend '{backend}' names {rollout_class!r}, which is not a subclass of "
            "verl_core.rollout.BaseRollout"
        )
    if isinstance(options, Mapping):
        options = structure(dict(options), entry.load("config"), "rollout.options", registry=registry)
    return entry.descriptor, rollout_class, options


def _run_checks(
    descriptor: Any, rollout_class: type, options: Any, model_dir: str, device: str, selected: tuple[str, ...]
) -> tuple[list[RankRecord], str | None]:
    from verl_core.config.engine import ModelConfig
    from verl_core.testing.rollout_checks import ROLLOUT_CHECKS, RolloutContext

    try:
        rollout = rollout_class(ModelConfig(path=model_dir, dtype="float32"), options, device=device)
        rollout.initialize()
    except Exception:
        return [], f"the rollout could not be built and initialised:\n{traceback.format_exc()}"
    ctx = RolloutContext(descriptor.name, rollout, model_dir, device, descriptor.capabilities)
    return [run_check(ROLLOUT_CHECKS[name], ctx, 0) for name in selected], None


@contextlib.contextmanager
def _quiet_transformers():
    """No loading progress bars or warnings from ``transformers`` while the kit runs; restored after."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
