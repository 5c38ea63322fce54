"""Configuration: attrs classes, YAML loading, dotted overrides, validation with full paths.

``load_config(paths, overrides)`` builds a ``RunConfig``, every component name resolved and every
rule checked before anything runs; ``structure`` / ``unstructure`` convert any config class from
and to plain data; ``dump_yaml`` writes what ``load_config`` reads back.
docs/config.md documents every section and key. Imports are lazy: importing this package (or one of
its light modules, ``verl_core.config.run``) imports neither torch nor cattrs nor yaml.
"""

from verl_core.lazy import lazy_exports

_EXPORTS = {
    "AsyncTrainingConfig": "verl_core.config.run",
    "DistillationConfig": "verl_core.config.run",
    "TeacherConfig": "verl_core.config.run",
    "AlgorithmConfig": "verl_core.config.algorithm",
    "CriticLossConfig": "verl_core.config.algorithm",
    "FilterGroupsConfig": "verl_core.config.algorithm",
    "KLControlConfig": "verl_core.config.algorithm",
    "PolicyLossConfig": "verl_core.config.algorithm",
    "RolloutCorrectionConfig": "verl_core.config.algorithm",
    "EngineConfig": "verl_core.config.engine",
    "MicroBatchConfig": "verl_core.config.engine",
    "ModelConfig": "verl_core.config.engine",
    "OptimConfig": "verl_core.config.engine",
    "OldLogProbsSource": "verl_core.config.run",
    "ActorConfig": "verl_core.config.run",
    "AgentConfig": "verl_core.config.run",
    "CriticConfig": "verl_core.config.run",
    "DataConfig": "verl_core.config.run",
    "RefConfig": "verl_core.config.run",
    "RewardConfig": "verl_core.config.run",
    "RolloutConfig": "verl_core.config.run",
    "RunConfig": "verl_core.config.run",
    "ServeConfig": "verl_core.config.serve",
    "TrainerConfig": "verl_core.config.run",
    "InvalidValue": "verl_core.config.validators",
    "at_least": "verl_core.config.validators",
    "each": "verl_core.config.validators",
    "greater_than": "verl_core.config.validators",
    "in_range": "verl_core.config.validators",
    "non_empty": "verl_core.config.validators",
    "non_negative": "verl_core.config.validators",
    "one_of": "verl_core.config.validators",
    "positive": "verl_core.config.validators",
    "unit_interval": "verl_core.config.validators",
    "structure": "verl_core.config.convert",
    "unstructure": "verl_core.config.convert",
    "dump_yaml": "verl_core.config.loading",
    "load_config": "verl_core.config.loading",
    "load_serve_config": "verl_core.config.loading",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
