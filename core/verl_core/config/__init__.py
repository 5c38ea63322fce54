"""Configuration: attrs classes, YAML loading, dotted overrides, validation with full paths."""

from verl_core.config.engine import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig

__all__ = ["EngineConfig", "MicroBatchConfig", "ModelConfig", "OptimConfig"]
