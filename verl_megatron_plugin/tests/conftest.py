"""Fixtures shared by the Megatron plugin's tests."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def megatron_jobs() -> types.ModuleType:
    """``megatron_jobs.py`` loaded by path: importable by name under neither of pytest's import modes."""
    spec = importlib.util.spec_from_file_location(
        "megatron_jobs", Path(__file__).with_name("megatron_jobs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
