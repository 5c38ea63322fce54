"""Fixtures shared by the ulysses plugin's tests."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
from fixtures import session


@pytest.fixture(scope="session")
def ulysses_jobs() -> types.ModuleType:
    """``ulysses_jobs.py`` loaded by path: importable by name under neither of pytest's import modes."""
    spec = importlib.util.spec_from_file_location("ulysses_jobs", Path(__file__).with_name("ulysses_jobs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo's small assets, the ones core's tests use (tests/fixtures/session.py)."""
    return session.demo(tmp_path_factory)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster, shared with core's tests (tests/fixtures/session.py)."""
    yield session.ray_cluster()
    session.stop_ray_cluster()
