"""The conformance kits: does an engine backend compute what a plain PyTorch model computes, and does
a rollout backend sample what the engine will score?

For a plugin's tests, subclass ``EngineConformance`` (pytest) for an engine, ``RolloutConformance``
for a rollout and ``PluginContract`` for the distribution; programmatically, call
``run_conformance(backend, world_size, ...)`` or ``run_rollout_conformance(backend, ...)``, each
returning a ``ConformanceReport``. The kits' material is public for authors' own tests: the tiny
models and batches (``save_tiny_models``, ``save_rollout_model``, ``make_samples``, ``collate``),
the reference and its loss functions, and ``spawn`` for tests on several ranks. docs/conformance.md explains every check, its tolerances,
how to read a failure, and each of these names.

Imports are lazy: spawned ranks import ``verl_core.testing.runner`` without pulling in pytest.
"""

from verl_core.lazy import exports_win_over_submodules, lazy_exports

_EXPORTS = {
    # pytest bases for a plugin's own tests
    "EngineConformance": "verl_core.testing.suite",
    "PluginContract": "verl_core.testing.contract",
    "assert_check": "verl_core.testing.suite",
    "run_conformance": "verl_core.testing.runner",
    "ConformanceReport": "verl_core.testing.report",
    "CheckOutcome": "verl_core.testing.report",
    "Comparison": "verl_core.testing.report",
    "CHECKS": "verl_core.testing.checks",
    "RolloutConformance": "verl_core.testing.suite",
    "run_rollout_conformance": "verl_core.testing.rollout_runner",
    "ROLLOUT_CHECKS": "verl_core.testing.rollout_checks",
    # the kit's material, for authors' own tests
    "TinyModelSpec": "verl_core.testing.tiny",
    "ModelDirs": "verl_core.testing.tiny",
    "save_tiny_models": "verl_core.testing.tiny",
    "Sample": "verl_core.testing.tiny",
    "make_samples": "verl_core.testing.tiny",
    "collate": "verl_core.testing.tiny",
    "shard": "verl_core.testing.tiny",
    "response_token_mask": "verl_core.testing.tiny",
    "policy_loss_fn": "verl_core.testing.losses",
    "value_loss_fn": "verl_core.testing.losses",
    "policy_token_loss": "verl_core.testing.losses",
    "load_reference_model": "verl_core.testing.reference",
    "reference_outputs": "verl_core.testing.reference",
    "reference_step": "verl_core.testing.reference",
    "save_rollout_model": "verl_core.testing.rollout_context",
    # running distributed tests
    "spawn": "verl_core.testing.spawn",
    "Rank": "verl_core.testing.spawn",
    "SpawnError": "verl_core.testing.spawn",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
exports_win_over_submodules(__name__, {"spawn"})
