"""verl-core: plugin-extensible RL post-training for language models.

This module is the public plugin API and stays light: importing it does not import torch or any
backend. Engines live in ``verl_core.engine``, algorithms in ``verl_core.algos``.
"""

from verl_core.descriptors import (
    ENGINE_API_VERSION,
    AdvantageEstimator,
    EngineBackend,
    PolicyLoss,
    RewardFunction,
    RolloutBackend,
)
from verl_core.hookspecs import ENTRY_POINT_GROUP, hookimpl

__version__ = "0.1.0"

__all__ = [
    "ENGINE_API_VERSION",
    "ENTRY_POINT_GROUP",
    "AdvantageEstimator",
    "EngineBackend",
    "PolicyLoss",
    "RewardFunction",
    "RolloutBackend",
    "hookimpl",
]
