"""Configuration: attrs classes, YAML loading, dotted overrides, validation with full paths.

``load_config(paths, overrides)`` builds a ``RunConfig``, every component name resolved and every
rule checked before anything runs; ``structure`` / ``unstructure`` convert any config class from
and to plain data; ``dump_yaml`` writes what ``load_config`` reads back.
docs/config.md documents every section and key. Importing this package does not import torch.
"""

from verl_core.config.algorithm import (
    AlgorithmConfig,
    CriticLossConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PolicyLossConfig,
)
from verl_core.config.convert import structure, structure_with_warnings, unstructure
from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from verl_core.config.loading import dump_yaml, load_config, parse_override
from verl_core.config.run import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from verl_core.config.validators import (
    InvalidValue,
    at_least,
    each,
    greater_than,
    in_range,
    non_empty,
    non_negative,
    one_of,
    positive,
    unit_interval,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "CriticLossConfig",
    "DataConfig",
    "EngineConfig",
    "FilterGroupsConfig",
    "InvalidValue",
    "KLControlConfig",
    "MicroBatchConfig",
    "ModelConfig",
    "OptimConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "at_least",
    "dump_yaml",
    "each",
    "greater_than",
    "in_range",
    "load_config",
    "non_empty",
    "non_negative",
    "one_of",
    "parse_override",
    "positive",
    "structure",
    "structure_with_warnings",
    "unit_interval",
    "unstructure",
]
