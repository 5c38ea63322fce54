"""The engine conformance kit: does an engine backend compute what a plain PyTorch model computes?

For a plugin's tests, subclass ``EngineConformance`` (pytest); programmatically, call
``run_conformance(backend, world_size, ...) -> ConformanceReport``. docs/conformance.md explains
every check, its tolerances, and how to read a failure.

Imports are lazy: spawned ranks import ``verl_core.testing.runner`` without pulling in pytest.
"""

from verl_core.lazy import lazy_exports

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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
