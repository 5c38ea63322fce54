"""How a run on several pytest-xdist workers (the full ``nox -s tests``: ``-n 2 --dist loadscope``) shares
out the tests of every distribution: in work units, each run whole by one worker, heaviest first.

Each worker is a pytest process of its own, with its own session fixtures (tests/fixtures/session.py),
so a test that shares a module- or class-scoped fixture with others must run where they run, or the
fixture (a spawned run, a saved model) is made again on the other worker. A unit is

- every test module that uses the session's Ray cluster (``ray_cluster``), together: one worker starts
  a cluster, and two never compete for the cores;
- a test module that declares a module-scoped fixture, whole;
- otherwise a test class (an engine's conformance suite: one spawned run per class), or the module's
  tests outside classes.

A unit is known from its test's id and its module's text alone, as xdist's scheduler sees it (it collects
nothing itself; ``xdist_group`` marks are lost on pytest 9.2, pytest-xdist issue 1386). Each worker
orders the collection heaviest unit first (those that spawn ranks or start Ray), and the scheduler hands
units out in that order: a long unit handed out last would keep one worker busy while the other has
nothing left to do. Nothing changes in a run without workers.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

#: The unit of the modules with tests on the session's Ray cluster.
RAY_UNIT = "ray"
#: Markers of the tests that start processes (a unit's cost, roughly): spawned ranks, builds.
HEAVY_MARKERS = ("distributed", "slow")


def unit_of(nodeid: str, root: Path) -> str:
    """The work unit of the test ``nodeid`` (relative to ``root``, the rootdir)."""
    module, *names = nodeid.split("[", 1)[0].split("::")
    sharing = _module_sharing(root / module)
    if sharing is not None:
        return sharing if sharing == RAY_UNIT else module
    return "::".join([module, *names[:-1]])  # the class, or the module for a test outside classes


@functools.cache
def _module_sharing(path: Path) -> str | None:
    """``RAY_UNIT`` or ``"module"`` where the module's tests share more than a class, else None."""
    try:
        source = path.read_text()
    except OSError:  # not a file (a doctest's id, a plugin's item): keep the module together
        return "module"
    if "ray_cluster" in source:
        return RAY_UNIT
    return "module" if 'scope="module"' in source else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # set in xdist's workers only
        return
    units = {item: unit_of(item.nodeid, config.rootpath) for item in items}
    heavy = {
        unit
        for item, unit in units.items()
        if unit == RAY_UNIT or any(item.get_closest_marker(name) for name in HEAVY_MARKERS)
    }
    # Every worker collects, and each must order the same way: a stable sort of the collection order.
    items.sort(key=lambda item: units[item] not in heavy)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """``--dist loadscope`` with this file's units as the scopes."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, config.rootpath)

    return UnitScheduling(config, log)
