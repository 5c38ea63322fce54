"""Fixtures shared by the FSDP plugin's tests."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

from verl_core.testing.tiny import ModelDirs, save_tiny_models


@pytest.fixture(scope="session")
def fsdp_jobs() -> types.ModuleType:
    """``fsdp_jobs.py`` loaded by path: importable by name under neither of pytest's import modes."""
    spec = importlib.util.spec_from_file_location("fsdp_jobs", Path(__file__).with_name("fsdp_jobs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> ModelDirs:
    """The conformance kit's tiny Qwen2 (``lm`` and ``value``), saved once per session."""
    return save_tiny_models(tmp_path_factory.mktemp("tiny") / "model")
