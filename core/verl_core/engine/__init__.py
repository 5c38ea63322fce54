"""The engine contract and the mechanics every backend shares.

``base`` (the contract), ``factory`` (``build_engine``), ``loop`` (the micro-batch loop), ``hf``
(loading and running Hugging Face models), ``logprob``, ``optim``, ``checkpoint``, ``device``,
``distributed`` (collectives over an optional group), ``seed``.
"""

from verl_core.engine.base import COMPUTE_ENTROPY, TEMPERATURE, BaseEngine, ForwardBackwardResult, LossFn
from verl_core.engine.factory import build_engine

__all__ = ["COMPUTE_ENTROPY", "TEMPERATURE", "BaseEngine", "ForwardBackwardResult", "LossFn", "build_engine"]
