"""Rollouts: generation backends, a plugin kind like engines (``rollout.backend``).

The contract is ``BaseRollout`` (``base``; contract 2's requests in ``requests``, its weight buckets in
``buckets``, the capabilities a backend declares with its descriptor); core's built-in backend ``hf``
(``hf``: its own KV-cache decoding loop over a Hugging Face causal LM, options in ``config``) is
registered through the ``verl_rollout_backends`` hook like any plugin's, so vLLM or SGLang rollouts plug
in the same way.
Imports are lazy: listing plugins and loading a config import no torch.
"""

from verl_core.deprecation import moved_names
from verl_core.lazy import lazy_exports

_EXPORTS = {
    "BaseRollout": "verl_core.rollout.base",
    "SamplingParams": "verl_core.rollout.params",
    "HFRollout": "verl_core.rollout.hf",
    "HFRolloutConfig": "verl_core.rollout.config",
    # contract 2 (its version and capability descriptors are verl_core's): requests, bucketed weight sync
    "RolloutRequest": "verl_core.rollout.requests",
    "RolloutResponse": "verl_core.rollout.requests",
    "FinishReason": "verl_core.rollout.requests",
    "WeightBucket": "verl_core.rollout.buckets",
    "weight_buckets": "verl_core.rollout.buckets",
    # how the weights reach separate replicas (a plugin kind, rollout.weight_transport)
    "BaseWeightTransport": "verl_core.rollout.transport",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(
    __name__,
    _EXPORTS,
    moved=moved_names(
        __name__,
        {
            "ROLLOUT_LOG_PROBS": "verl_core.data:ROLLOUT_LOG_PROBS",
            "RolloutError": "verl_core.errors:RolloutError",
        },
        since="0.2.0",
        removed_in="0.4.0",
    ),
)
