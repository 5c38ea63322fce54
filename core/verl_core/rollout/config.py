"""The options of core's built-in ``hf`` rollout (``rollout.hf`` in a run config).

Light on purpose (attrs only, no torch): the config loader structures these options while a config
loads, before any rollout is built.
"""

from __future__ import annotations

import attrs

from verl_core.config.validators import non_negative


@attrs.define
class HFRolloutConfig:
    """How the built-in rollout decodes with its own copy of a Hugging Face causal LM."""

    #: Sequences decoded together on each rank; 0 decodes a rank's whole share at once. Lower it to
    #: bound the KV cache's memory (it grows with sequences x (prompt + response) tokens).
    max_batch_size: int = attrs.field(default=0, validator=non_negative)
    #: The attention kernel of the rollout's model (``sdpa`` or ``eager``).
    attn_implementation: str = "sdpa"
    #: Decode Llama-architecture models (Llama, Qwen2) with ``verl_core.rollout.decoder.LeanDecoder``
    #: (the same logits, a fraction of the Python overhead per step; ``sdpa`` only); false, or another
    #: architecture, decodes with the model's own forward pass.
    lean_decoder: bool = True
    #: With ``lean_decoder`` on a CPU, keep a second copy of the weights of at least 300k elements
    #: (``PACKED_MIN_ELEMENTS``) laid out for the CPU's kernels (MKL's packed float32, oneDNN's blocked
    #: bfloat16/float16; ``verl_core.rollout.decoder.Projection``): SmolLM2-135M's decoding steps at 16
    #: rows take 9-20% less time, in float32 and in bfloat16; smaller weights (the demo's models) decode
    #: faster without. False saves the copy's memory (as much again as those weights).
    packed_weights: bool = True
