"""Descriptors of core's built-in rollout backends, by import string (no torch import here)."""

from __future__ import annotations

from verl_core.descriptors import RolloutBackend, RolloutCapabilities, WeightTransport

#: What the built-in ``hf`` rollout does beyond contract 1 (``verl_core.rollout.hf``); its
#: ``prefix_caching``: the ``n`` samples of a prompt share its prefill, and a request is served from the
#: KV caches of recent ones (``rollout.hf.prefix_cache_sequences``). Its log-probs differ from the
#: reference's by ~1e-6 in float32 on the kit's model (the rollout kit prints the measured value); the
#: declared bound is the one rollout kit 1 held it to.
HF_CAPABILITIES = RolloutCapabilities(
    requests="serial",
    abort_resume=True,
    prefix_caching=True,
    sleep=True,
    sleep_frees_weights=False,
    log_prob_semantics="tempered",
    dtypes=("float32", "bfloat16", "float16"),
    log_prob_tolerance=1e-5,
)

ROLLOUT_BACKENDS: tuple[RolloutBackend, ...] = (
    RolloutBackend(
        name="hf",
        rollout="verl_core.rollout.hf:HFRollout",
        config="verl_core.rollout.config:HFRolloutConfig",
        devices=("cpu", "cuda"),
        description="Hugging Face causal LMs with core's own KV-cache decoding loop; weights synced in memory",
        api_version=2,
        capabilities=HF_CAPABILITIES,
    ),
)

WEIGHT_TRANSPORTS: tuple[WeightTransport, ...] = (
    WeightTransport(
        name="object_store",
        transport="verl_core.rollout.transport:ObjectStoreTransport",
        description="each bucket put once into Ray's object store; replicas fetch it, across nodes",
        workers=("ray",),
    ),
    WeightTransport(
        name="memory",
        transport="verl_core.rollout.transport:MemoryTransport",
        description="the buckets handed over in the driver's process (in-process workers)",
        workers=("in_process",),
    ),
)
