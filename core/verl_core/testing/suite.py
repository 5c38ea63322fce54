"""``EngineConformance`` and ``RolloutConformance``: the conformance checks as pytest tests, for a
plugin's own test suite.

Subclass one in a test module, name the backend, done::

    from verl_core.testing import EngineConformance

    class TestMyConformance(EngineConformance):
        backend = "my-backend"
        world_sizes = (1, 2)

Each world size is one spawned run (class-scoped, so it runs once); there is one test per check of
``CHECKS`` (``test_conformance[world_size=2-first_step]``), each asserting its check's part of that
run's report, with a message saying what differed and by how much. A check that cannot be exercised
on the device or world size (offload on the CPU, DP invariance with one DP rank) is skipped with the
reason, never passed.

A rollout backend likewise::

    from verl_core.testing import RolloutConformance

    class TestMyRolloutConformance(RolloutConformance):
        backend = "my-rollout"

One in-process run per class (a rollout owns no process group), one test per check of
``ROLLOUT_CHECKS`` (``test_rollout_conformance[weight_sync]``).

A backend that knowingly fails a check declares it, with the reason, in ``expected_failed_checks``
(as scikit-learn's estimators do): the test of that check is then an expected failure, and a strict
one: once the check passes, its test fails, saying to remove the declaration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from verl_core.testing.checks import CHECKS
from verl_core.testing.report import ConformanceReport
from verl_core.testing.rollout_checks import ROLLOUT_CHECKS
from verl_core.testing.rollout_runner import run_rollout_conformance
from verl_core.testing.runner import run_conformance


class EngineConformance:
    """Base class of a backend's conformance tests (see the module docstring and docs/conformance.md)."""

    #: The engine backend's name, looked up through the plugin registry as a user's config would be.
    backend: ClassVar[str] = ""
    #: One spawned run per world size (gloo ranks on CPU). Each must divide 12, the kit's batch size.
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2)
    #: The backend's options: an instance of its config class, a mapping, or None for the defaults.
    options: ClassVar[Any] = None
    #: Plugin modules (or their names) to load besides the installed ones, e.g. a test plugin.
    plugins: ClassVar[tuple[Any, ...]] = ()
    #: Load installed plugins through entry points; None follows VERL_CORE_DISABLE_PLUGIN_AUTOLOAD.
    autoload: ClassVar[bool | None] = None
    device: ClassVar[str] = "cpu"
    #: Hard limit on one run (all checks at one world size).
    timeout_s: ClassVar[float] = 600.0
    #: The checks the backend knowingly fails, each with the reason: ``{"offload": "no CPU offload
    #: yet, see issue 12"}``. At every world size, each is an expected failure (``xfailed``), and a
    #: test failure once it passes.
    expected_failed_checks: ClassVar[Mapping[str, str]] = {}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # pytest calls this method of a test class to parametrize its tests: one run per world size
        # (class-scoped, shared by its tests), one test per check. The tests come from the list of
        # checks itself, so a check can never run without being asserted.
        if "conformance_world_size" in metafunc.fixturenames:
            metafunc.parametrize(
                "conformance_world_size",
                [
                    pytest.param(size, marks=pytest.mark.distributed, id=f"world_size={size}")
                    for size in self.world_sizes
                ],
                scope="class",
            )
        if "conformance_check" in metafunc.fixturenames:
            metafunc.parametrize("conformance_check", list(CHECKS))

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_report(cls, conformance_world_size: int) -> ConformanceReport:
        if not cls.backend:
            pytest.fail(f"{cls.__name__}: set the class attribute backend = '<engine backend name>'")
        return run_conformance(
            cls.backend,
            conformance_world_size,
            options=cls.options,
            plugins=cls.plugins,
            autoload=cls.autoload,
            device=cls.device,
            timeout_s=cls.timeout_s,
            expected_failed_checks=cls.expected_failed_checks,
        )

    def test_conformance(self, conformance_report: ConformanceReport, conformance_check: str) -> None:
        """One test per check of ``verl_core.testing.checks.CHECKS``: a new check is a new test."""
        assert_check(conformance_report, conformance_check)


class RolloutConformance:
    """Base class of a rollout backend's conformance tests (see the module docstring and
    docs/conformance.md)."""

    #: The rollout backend's name, looked up through the plugin registry as ``rollout.backend`` is.
    backend: ClassVar[str] = ""
    #: The backend's options: an instance of its config class, a mapping, or None for the defaults.
    options: ClassVar[Any] = None
    #: Plugin modules (or their names) to load besides the installed ones, e.g. a test plugin.
    plugins: ClassVar[tuple[Any, ...]] = ()
    #: Load installed plugins through entry points; None follows VERL_CORE_DISABLE_PLUGIN_AUTOLOAD.
    autoload: ClassVar[bool | None] = None
    #: Where the rollout runs (``cpu``, ``cuda``); the reference runs on the CPU.
    device: ClassVar[str] = "cpu"
    #: The checks the backend knowingly fails, each with the reason: expected failures, strictly.
    expected_failed_checks: ClassVar[Mapping[str, str]] = {}
    #: The kit's model (``TinyModelSpec``; None: the default, heads of 8 dimensions). An inference engine
    #: whose attention kernels need wider heads (vLLM's CPU backend: 32 or more) passes a wider model.
    model_spec: ClassVar[Any] = None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # One test per check, generated from the list of checks: none can run unasserted.
        if "rollout_check" in metafunc.fixturenames:
            metafunc.parametrize("rollout_check", list(ROLLOUT_CHECKS))

    @pytest.fixture(scope="class")
    @classmethod
    def rollout_report(cls, tmp_path_factory: pytest.TempPathFactory) -> ConformanceReport:
        if not cls.backend:
            pytest.fail(f"{cls.__name__}: set the class attribute backend = '<rollout backend name>'")
        return run_rollout_conformance(
            cls.backend,
            options=cls.options,
            plugins=cls.plugins,
            autoload=cls.autoload,
            device=cls.device,
            workdir=tmp_path_factory.mktemp("rollout-conformance"),
            expected_failed_checks=cls.expected_failed_checks,
            model_spec=cls.model_spec,
        )

    def test_rollout_conformance(self, rollout_report: ConformanceReport, rollout_check: str) -> None:
        """One test per check of ``verl_core.testing.rollout_checks.ROLLOUT_CHECKS``."""
        assert_check(rollout_report, rollout_check)


def assert_check(report: ConformanceReport, check: str) -> None:
    """Pass, skip, xfail or fail the calling test as ``report`` says of ``check``."""
    outcome = report[check]
    if outcome.status == "skipped":
        pytest.skip("; ".join(outcome.reasons))
    if outcome.status == "xfailed":
        pytest.xfail(f"{report.subject}: {outcome.describe()}")
    if not outcome.passed:
        run_error = f"\n(the run itself broke: {report.error})" if report.error else ""
        pytest.fail(
            f"{report.subject}: {outcome.describe()}{run_error}",
            pytrace=False,
        )
