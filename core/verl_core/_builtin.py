"""Core's own built-ins, registered through the same hooks as any third-party plugin."""

from __future__ import annotations

from verl_core.agents import catalog as agents_catalog
from verl_core.algos import catalog
from verl_core.descriptors import (
    AdvantageEstimator,
    Environment,
    MetricSink,
    PolicyLoss,
    RewardFunction,
    RolloutBackend,
    WeightTransport,
)
from verl_core.hookspecs import hookimpl
from verl_core.reward import catalog as reward_catalog
from verl_core.rollout import catalog as rollout_catalog
from verl_core.trainer import catalog as trainer_catalog


@hookimpl
def verl_advantage_estimators() -> list[AdvantageEstimator]:
    return list(catalog.ADVANTAGE_ESTIMATORS)


@hookimpl
def verl_policy_losses() -> list[PolicyLoss]:
    return list(catalog.POLICY_LOSSES)


@hookimpl
def verl_reward_functions() -> list[RewardFunction]:
    return list(reward_catalog.REWARD_FUNCTIONS)


@hookimpl
def verl_rollout_backends() -> list[RolloutBackend]:
    return list(rollout_catalog.ROLLOUT_BACKENDS)


@hookimpl
def verl_environments() -> list[Environment]:
    return list(agents_catalog.ENVIRONMENTS)


@hookimpl
def verl_weight_transports() -> list[WeightTransport]:
    return list(rollout_catalog.WEIGHT_TRANSPORTS)


@hookimpl
def verl_metric_sinks() -> list[MetricSink]:
    return list(trainer_catalog.METRIC_SINKS)
