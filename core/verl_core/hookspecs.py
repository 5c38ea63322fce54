"""The plugin contract: every hook a verl-core plugin may implement.

Each hook takes no arguments and returns a list of descriptors (see ``verl_core.descriptors``);
core collects them, attributes each to the plugin and distribution that returned it, and refuses
duplicates, wrong types and incompatible API versions. Hooks must be cheap: return descriptors
that name heavy objects by import string, and import nothing heavy at module level.
"""

from __future__ import annotations

import pluggy

from verl_core.deprecation import moved_names
from verl_core.descriptors import (
    AdvantageEstimator,
    Choice,
    EngineBackend,
    Environment,
    MetricSink,
    PolicyLoss,
    RewardFunction,
    RolloutBackend,
    WeightTransport,
)

#: The hooks; ``hookimpl`` and ``ENTRY_POINT_GROUP`` are public from ``verl_core``, ``Kind`` from
#: ``verl_core.plugins``.
__all__ = [
    "verl_advantage_estimators",
    "verl_engine_backends",
    "verl_environments",
    "verl_policy_losses",
    "verl_reward_functions",
    "verl_rollout_backends",
    "verl_weight_transports",
    "verl_metric_sinks",
]

PROJECT_NAME = "verl_core"
ENTRY_POINT_GROUP = "verl_core.plugins"
HOOK_PREFIX = "verl_"


class Kind(Choice):
    """What plugins provide, one kind per hook (its name without ``verl_``): the first argument of the
    registry's lookups, ``get_registry().get(Kind.ENGINE_BACKENDS, "fsdp")``."""

    ENGINE_BACKENDS = "engine_backends"
    ADVANTAGE_ESTIMATORS = "advantage_estimators"
    POLICY_LOSSES = "policy_losses"
    ROLLOUT_BACKENDS = "rollout_backends"
    REWARD_FUNCTIONS = "reward_functions"
    ENVIRONMENTS = "environments"
    WEIGHT_TRANSPORTS = "weight_transports"
    METRIC_SINKS = "metric_sinks"


hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def verl_engine_backends() -> list[EngineBackend]:
    """Return the engine backends this plugin provides.

    :return: a list (or tuple) of ``EngineBackend``; ``[]`` or no implementation for none. A config
        selects one with ``<section>.engine.backend`` (``actor.engine.backend: fsdp``).

    Called once per plugin when the registry is built (the first ``get_registry()`` of a process, and
    ``verl-core plugins``), before any engine is needed: import nothing heavy here, name the engine and
    its options class by import string. Raising, returning another type, or an invalid descriptor makes
    the plugin ``broken`` (its error names it); the other plugins keep working. A backend whose
    ``api_version`` core does not accept is listed ``incompatible`` and refused on lookup.
    """


@hookspec
def verl_advantage_estimators() -> list[AdvantageEstimator]:
    """Return the advantage estimators this plugin provides.

    :return: a list (or tuple) of ``AdvantageEstimator``, selected by ``algorithm.adv_estimator``.

    Called once per plugin when the registry is built; the estimator's function is imported when a
    run selects it. Failures make the plugin ``broken``, as for ``verl_engine_backends``.
    """


@hookspec
def verl_policy_losses() -> list[PolicyLoss]:
    """Return the policy losses this plugin provides.

    :return: a list (or tuple) of ``PolicyLoss``, selected by ``actor.policy_loss.loss_mode``.

    Called once per plugin when the registry is built; the loss function is imported when a run
    selects it. Failures make the plugin ``broken``, as for ``verl_engine_backends``.
    """


@hookspec
def verl_rollout_backends() -> list[RolloutBackend]:
    """Return the rollout (generation) backends this plugin provides.

    :return: a list (or tuple) of ``RolloutBackend``, selected by ``rollout.backend``.

    Called once per plugin when the registry is built; the rollout class and its options class are
    imported when a run selects them. Failures make the plugin ``broken``, as for
    ``verl_engine_backends``; a backend whose rollout ``api_version`` core does not accept is listed
    ``incompatible`` and refused on lookup.
    """


@hookspec
def verl_reward_functions() -> list[RewardFunction]:
    """Return the reward functions this plugin provides.

    :return: a list (or tuple) of ``RewardFunction``, selected by ``reward.function`` (which may also
        be ``path/to/file.py:function`` without any plugin).

    Called once per plugin when the registry is built; the function is imported when a run selects
    it. Failures make the plugin ``broken``, as for ``verl_engine_backends``.
    """


@hookspec
def verl_environments() -> list[Environment]:
    """Return the environments (multi-turn rollouts: tools, games, simulated users) this plugin provides.

    :return: a list (or tuple) of ``Environment``, selected by ``rollout.agent.environment``.

    Called once per plugin when the registry is built; the environment factory is imported when a run
    selects it. Failures make the plugin ``broken``, as for ``verl_engine_backends``.
    """


@hookspec
def verl_weight_transports() -> list[WeightTransport]:
    """Return the weight transports (how the trained weights reach separate rollout replicas) this
    plugin provides.

    :return: a list (or tuple) of ``WeightTransport``, selected by ``rollout.weight_transport``.

    Called once per plugin when the registry is built; the transport class is imported when a run
    selects it. Failures make the plugin ``broken``, as for ``verl_engine_backends``.
    """


@hookspec
def verl_metric_sinks() -> list[MetricSink]:
    """Return the metric sinks (experiment trackers, dashboards) this plugin provides.

    :return: a list (or tuple) of ``MetricSink``, selected by naming them in ``trainer.logger``.

    Called once per plugin when the registry is built; the sink class is imported when a run names
    it. Failures make the plugin ``broken``, as for ``verl_engine_backends``; a sink whose
    ``requires`` are not installed is listed ``unavailable`` and refused with its ``install`` command.
    """


__getattr__ = moved_names(
    __name__,
    {kind.name: f"verl_core.plugins:Kind.{kind.name}" for kind in Kind},
    since="0.2.0",
    removed_in="0.4.0",
)
