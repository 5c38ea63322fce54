"""verl-core: plugin-extensible RL post-training for language models.

This module is the public plugin API and stays light: importing it does not import torch or any
backend. The engine contract lives in ``verl_core.engine``, what engines are built from in
``verl_core.toolkit``, algorithms in ``verl_core.algos``. docs/api.md lists every public name (each has
one home) and the policy by which they change.
"""

from verl_core.descriptors import (
    ENGINE_API_VERSION,
    MIN_ENGINE_API_VERSION,
    MIN_ROLLOUT_API_VERSION,
    ROLLOUT_API_VERSION,
    AdvantageEstimator,
    EngineBackend,
    Environment,
    LogProbSemantics,
    MetricSink,
    ModelRole,
    PolicyLoss,
    RequestMode,
    RewardFunction,
    RolloutBackend,
    RolloutCapabilities,
    WeightTransport,
)
from verl_core.hookspecs import ENTRY_POINT_GROUP, hookimpl

__version__ = "0.2.0"

__all__ = [
    "ENGINE_API_VERSION",
    "ENTRY_POINT_GROUP",
    "MIN_ENGINE_API_VERSION",
    "MIN_ROLLOUT_API_VERSION",
    "ROLLOUT_API_VERSION",
    "AdvantageEstimator",
    "EngineBackend",
    "Environment",
    "LogProbSemantics",
    "MetricSink",
    "ModelRole",
    "PolicyLoss",
    "RequestMode",
    "RewardFunction",
    "RolloutBackend",
    "RolloutCapabilities",
    "WeightTransport",
    "hookimpl",
]
