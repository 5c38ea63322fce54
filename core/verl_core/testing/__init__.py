"""The engine conformance kit: does an engine backend compute what a plain PyTorch model computes?

For a plugin's tests, subclass ``EngineConformance`` (pytest); programmatically, call
``run_conformance(backend, world_size, ...) -> ConformanceReport``. docs/conformance.md explains
every check, its tolerances, and how to read a failure.

Imports are lazy: spawned ranks import ``verl_core.testing.runner`` without pulling in pytest.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConformance": "verl_core.testing.suite",
    "assert_check": "verl_core.testing.suite",
    "run_conformance": "verl_core.testing.runner",
    "ConformanceReport": "verl_core.testing.report",
    "CheckOutcome": "verl_core.testing.report",
    "Comparison": "verl_core.testing.report",
    "CHECKS": "verl_core.testing.checks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verl_core.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
