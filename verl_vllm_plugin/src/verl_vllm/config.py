"""The options of the ``vllm`` rollout backend (``rollout.vllm`` in a run config).

Light on purpose (attrs only, no torch, no vLLM): the config loader structures these options while a
config loads, before any rollout is built.
"""

from __future__ import annotations

from typing import Any

import attrs

from verl_core.config.validators import InvalidValue, in_range, positive

#: The KV cache of an engine on a CPU when ``kv_cache_megabytes`` is not set.
DEFAULT_CPU_KV_CACHE_MEGABYTES = 1024

#: ``EngineArgs`` the rollout sets on vLLM's CPU build unless ``engine_kwargs`` says otherwise. Each
#: prompt is prefilled in one step: a prefill split over steps discards the token sampled after each
#: part and rewinds the request's seeded generator, which a CPU generator cannot do ("CPU Generator
#: does not use offset", the engine dies). The token budget of a step then covers ``max_model_len``.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {"enable_chunked_prefill": False}

#: ``EngineArgs`` the rollout sets itself, each with what to use instead: passing one through
#: ``engine_kwargs`` would change what the rollout's contract promises (its log-probs, its model, its
#: seeds, where it runs) behind its back.
RESERVED_ENGINE_KWARGS: dict[str, str] = {
    "model": "actor.engine.model.path",
    "tokenizer": "actor.engine.model.path (the rollout takes token ids: it loads no tokenizer)",
    "skip_tokenizer_init": "nothing (the rollout takes token ids: it loads no tokenizer)",
    "dtype": "rollout.dtype",
    "seed": "nothing (every request is seeded from the call's seed)",
    "logprobs_mode": "nothing (the rollout reports log_softmax(logits / T) before top-k / top-p)",
    "trust_remote_code": "actor.engine.model.trust_remote_code",
    "max_model_len": "rollout.vllm.max_model_len",
    "kv_cache_memory_bytes": "rollout.vllm.kv_cache_megabytes",
    "gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "enable_prefix_caching": "rollout.vllm.enable_prefix_caching",
    "block_size": "rollout.vllm.block_size",
    "enforce_eager": "rollout.vllm.enforce_eager",
    "tensor_parallel_size": "rollout.vllm.tensor_parallel_size",
    "distributed_executor_backend": "rollout.vllm.tensor_parallel_size (it chooses the executor)",
    "enable_sleep_mode": "rollout.vllm.enable_sleep_mode",
}


def engine_kwargs_for(options: VLLMRolloutConfig, cpu: bool) -> dict[str, Any]:
    """``options.engine_kwargs`` over the rollout's defaults for the device's vLLM build."""
    return {**(CPU_ENGINE_DEFAULTS if cpu else {}), **options.engine_kwargs}


def _engine_kwargs(instance: VLLMRolloutConfig, attribute: attrs.Attribute, value: dict[str, Any]) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise InvalidValue(
            attribute.name, f"must be a mapping of vLLM EngineArgs names to values, got {value!r}"
        )
    for key in sorted(value):
        if key in RESERVED_ENGINE_KWARGS:
            raise InvalidValue(
                f"{attribute.name}.{key}",
                f"the rollout sets {key} itself; use {RESERVED_ENGINE_KWARGS[key]} instead",
            )


def _block_size(instance: VLLMRolloutConfig, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (value < 1 or value & (value - 1) and value % 32):
        raise InvalidValue(attribute.name, f"must be a power of two or a multiple of 32, got {value!r}")


@attrs.define
class VLLMRolloutConfig:
    """How the rollout runs its vLLM engine: one engine in each of the actor's processes (colocated
    with the training engine), stepped in that process."""

    #: The longest sequence (prompt plus response) the engine serves. None: the model's
    #: ``max_position_embeddings``. Must hold ``rollout.prompt_length + rollout.response_length``.
    max_model_len: int | None = attrs.field(default=None, validator=positive)
    #: The KV cache, in MiB per rank. None: 1024 MiB on a CPU; on a GPU what
    #: ``gpu_memory_utilization`` leaves after the weights. It must hold one rank's share of a step:
    #: ``data.train_batch_size * rollout.n / ranks`` sequences of prompt plus response tokens (checked
    #: before start-up), or vLLM preempts and recomputes sequences, many times slower.
    kv_cache_megabytes: int | None = attrs.field(default=None, validator=positive)
    #: On a GPU, the fraction of its memory the engine may take (weights, activations, KV cache) when
    #: ``kv_cache_megabytes`` is not set. The training engine shares the GPU: leave it room.
    gpu_memory_utilization: float = attrs.field(default=0.5, validator=in_range(0, 1, include_low=False))
    #: Share the KV cache of common prefixes between sequences (the ``n`` samples of a prompt prefill it
    #: once). The cache is reset after every weight update, so it never serves the old weights.
    enable_prefix_caching: bool = True
    #: Tokens per KV cache block (the unit of prefix sharing). None: vLLM's (128 on a CPU, 16 on a GPU).
    #: vLLM's CPU attention needs a multiple of 32.
    block_size: int | None = attrs.field(default=None, validator=[positive, _block_size])
    #: Run the model eagerly. None: eagerly on a CPU, with CUDA graphs on a GPU (captured at start-up).
    enforce_eager: bool | None = None
    #: GPUs each engine spans (vLLM's tensor parallelism, over consecutive actor ranks with vLLM's
    #: ``external_launcher``: every rank of a group generates the group's prompts). 1 on a CPU.
    tensor_parallel_size: int = attrs.field(default=1, validator=positive)
    #: vLLM's sleep mode (``sleep()`` frees the KV cache and moves the weights to host memory). None:
    #: on where vLLM has it (CUDA); vLLM's CPU backend has none.
    enable_sleep_mode: bool | None = None
    #: Further ``vllm.EngineArgs``, passed through unchecked (``max_num_seqs``, ``max_num_batched_tokens``,
    #: ...): valid for the vLLM release installed. Those the rollout sets itself are refused, naming
    #: the key to use instead. On a CPU, ``enable_chunked_prefill`` is refused (``CPU_ENGINE_DEFAULTS``)
    #: and ``max_num_batched_tokens`` must hold the engine's ``max_model_len``.
    engine_kwargs: dict[str, Any] = attrs.field(factory=dict, validator=_engine_kwargs)
