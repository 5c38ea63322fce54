"""The engine contract and the mechanics every backend shares."""

from verl_core.engine.base import COMPUTE_ENTROPY, TEMPERATURE, BaseEngine, ForwardBackwardResult, LossFn

__all__ = ["COMPUTE_ENTROPY", "TEMPERATURE", "BaseEngine", "ForwardBackwardResult", "LossFn"]
