"""Fixtures shared by the ulysses plugin's tests."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ulysses_jobs() -> types.ModuleType:
    """``ulysses_jobs.py`` loaded by path: importable by name under neither of pytest's import modes."""
    spec = importlib.util.spec_from_file_location("ulysses_jobs", Path(__file__).with_name("ulysses_jobs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
