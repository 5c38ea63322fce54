"""What the ``vllm`` rollout refuses before any worker starts (``VLLMRollout.check_before_start``).

Each problem is ``(key, message)``, the key a run config's (``rollout.vllm.max_model_len``,
``rollout.dtype``, ``rollout.backend``), the message naming the fix. Two kinds of check:

- from the config and the model's ``config.json`` alone: a ``max_model_len`` that cannot hold a prompt
  and its response, a KV cache too small for one rank's share of a step (vLLM would preempt and
  recompute sequences, many times slower), a block size or tensor parallelism vLLM's CPU backend does
  not run, attention heads it has no kernel for;
- by vLLM itself, on the machine running the check when its vLLM serves the rollout's device: the
  dtypes its platform runs, and ``EngineArgs(...).create_engine_config()``, which resolves the model's
  architecture (one vLLM cannot load is refused) and the engine's settings without loading a weight.
  Importing vLLM takes 10-40 s; the run's workers import it anyway.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from verl_vllm.config import DEFAULT_CPU_KV_CACHE_MEGABYTES, VLLMRolloutConfig, engine_kwargs_for
from verl_vllm.plugin import cpu_build

#: vLLM's default tokens per KV cache block, on a CPU and on a GPU.
DEFAULT_BLOCK_SIZE = {True: 128, False: 16}
#: vLLM's CPU attention kernels work on blocks of a multiple of this many tokens.
CPU_BLOCK_MULTIPLE = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def text_config(model_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a ``config.json`` (a multimodal model nests it)."""
    nested = model_config.get("text_config")
    return nested if isinstance(nested, Mapping) else model_config


def head_dim(config: Mapping[str, Any]) -> int | None:
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if hidden and heads else None


def problems_before_start(
    config: Any,
    model: Any,
    model_config: Mapping[str, Any],
    world_size: int,
    batch_size: int,
    config_path: str,
) -> Iterator[tuple[str, str]]:
    """``BaseRollout.check_before_start``'s problems (its arguments, in its order)."""
    options = config.options if isinstance(config.options, VLLMRolloutConfig) else VLLMRolloutConfig()
    key = f"{config_path}.vllm"
    cpu = cpu_build()
    text = text_config(model_config)
    longest = config.prompt_length + config.response_length
    positions = text.get("max_position_embeddings")
    block = options.block_size or DEFAULT_BLOCK_SIZE[cpu]
    problems = [
        *_lengths(options, key, config_path, longest, positions),
        *_parallelism(options, key, cpu, world_size),
        *_kv_cache(options, key, cpu, text, model.dtype, config, world_size, batch_size, longest, block),
        *(_cpu_prefill(options, key, options.max_model_len or positions or longest) if cpu else ()),
    ]
    if cpu and block % CPU_BLOCK_MULTIPLE:
        problems.append(
            (
                f"{key}.block_size",
                f"{block} tokens: vLLM's CPU attention runs blocks of a multiple of {CPU_BLOCK_MULTIPLE} "
                f"tokens; set block_size to {CPU_BLOCK_MULTIPLE} (the smallest, for prefix sharing) or a "
                "multiple of it",
            )
        )
    yield from problems
    if not problems:  # vLLM would refuse the same settings again, less precisely
        yield from _by_vllm(options, key, config_path, cpu, text, model, config, longest, positions)


def _lengths(
    options: VLLMRolloutConfig, key: str, config_path: str, longest: int, positions: int | None
) -> Iterator[tuple[str, str]]:
    wanted = f"{config_path}.prompt_length + {config_path}.response_length = {longest} tokens"
    if options.max_model_len is not None:
        if positions and options.max_model_len > positions:
            yield (
                f"{key}.max_model_len",
                f"{options.max_model_len} is more than the model's max_position_embeddings={positions} "
                f"(config.json), which vLLM refuses: set max_model_len <= {positions}",
            )
        elif options.max_model_len < longest:
            yield (
                f"{key}.max_model_len",
                f"{options.max_model_len} tokens cannot hold {wanted}: set max_model_len >= {longest} (or leave "
                "it out: the model's max_position_embeddings)",
            )
    elif positions and positions < longest:
        yield (
            f"{config_path}.response_length",
            f"{wanted}, more than the model's max_position_embeddings={positions} (config.json), the longest "
            f"sequence vLLM serves for it: shorten {config_path}.prompt_length or {config_path}.response_length",
        )


def _cpu_prefill(options: VLLMRolloutConfig, key: str, max_model_len: int) -> Iterator[tuple[str, str]]:
    """A CPU engine prefills each prompt in one step (``verl_vllm.config.CPU_ENGINE_DEFAULTS``)."""
    kwargs = options.engine_kwargs
    if kwargs.get("enable_chunked_prefill"):
        yield (
            f"{key}.engine_kwargs.enable_chunked_prefill",
            "vLLM's CPU build dies on a seeded request whose prompt is prefilled over several steps (its "
            "sampler rewinds the request's generator: 'CPU Generator does not use offset'); leave it out: "
            "the rollout prefills each prompt in one step",
        )
    budget = kwargs.get("max_num_batched_tokens")
    if isinstance(budget, int) and budget < max_model_len:
        yield (
            f"{key}.engine_kwargs.max_num_batched_tokens",
            f"{budget} tokens a step cannot prefill a prompt of the engine's max_model_len={max_model_len} in "
            f"one step, as vLLM's CPU build must: set it >= {max_model_len}, or leave it out",
        )


def _parallelism(
    options: VLLMRolloutConfig, key: str, cpu: bool, world_size: int
) -> Iterator[tuple[str, str]]:
    tp = options.tensor_parallel_size
    if tp == 1:
        return
    if cpu:
        yield (
            f"{key}.tensor_parallel_size",
            f"{tp}: the rollout runs one vLLM CPU engine in each actor rank; set tensor_parallel_size=1",
        )
    elif world_size % tp:
        yield (
            f"{key}.tensor_parallel_size",
            f"{tp} does not divide the actor's {world_size} ranks (trainer.world_size), over which the rollout's "
            "tensor-parallel groups are laid: choose a divisor",
        )


def _kv_cache(
    options: VLLMRolloutConfig,
    key: str,
    cpu: bool,
    text: Mapping[str, Any],
    dtype: str,
    config: Any,
    world_size: int,
    batch_size: int,
    longest: int,
    block: int,
) -> Iterator[tuple[str, str]]:
    megabytes = options.kv_cache_megabytes or (DEFAULT_CPU_KV_CACHE_MEGABYTES if cpu else None)
    dim = head_dim(text)
    layers = text.get("num_hidden_layers")
    kv_heads = text.get("num_key_value_heads") or text.get("num_attention_heads")
    if megabytes is None or not (dim and layers and kv_heads) or dtype not in DTYPE_BYTES:
        return  # sized by vLLM from the GPU's memory, or a config.json this rule cannot read
    tp = options.tensor_parallel_size
    per_token = 2 * layers * math.ceil(kv_heads / tp) * dim * DTYPE_BYTES[dtype]  # keys and values
    per_sequence = math.ceil(longest / block) * block * per_token
    sequences = math.ceil(batch_size * config.n * tp / world_size)
    fits = (megabytes << 20) // per_sequence
    if sequences <= fits:
        return
    needed = math.ceil(sequences * per_sequence / (1 << 20))
    default = " (the default on a CPU)" if options.kv_cache_megabytes is None else ""
    yield (
        f"{key}.kv_cache_megabytes",
        f"{megabytes} MiB{default} holds {fits} sequences of {longest} tokens ({block}-token blocks, "
        f"{per_token} bytes per token: {layers} layers x {math.ceil(kv_heads / tp)} KV heads x {dim} x 2 "
        f"x {DTYPE_BYTES[dtype]} bytes), and each engine generates {sequences} at once (data.train_batch_size "
        f"{batch_size} x rollout.n {config.n} over {world_size // tp} engine(s)): set kv_cache_megabytes >= "
        f"{needed}",
    )


def _by_vllm(
    options: VLLMRolloutConfig,
    key: str,
    config_path: str,
    cpu: bool,
    text: Mapping[str, Any],
    model: Any,
    config: Any,
    longest: int,
    positions: int | None,
) -> Iterator[tuple[str, str]]:
    """The checks vLLM makes itself, where the vLLM installed here serves the rollout's device."""
    import torch

    if not cpu and not torch.cuda.is_available():
        return  # a GPU build on a machine without one (a CPU head node): its ranks check at start-up
    from verl_vllm.engine import VLLM_MODULES, import_vllm

    import_vllm((*VLLM_MODULES, "vllm.v1.attention.backends.cpu_attn") if cpu else VLLM_MODULES)
    from vllm.platforms import current_platform

    from verl_core.toolkit.model import DTYPES

    dtype_key = f"{config_path}.dtype" if config.dtype else "actor.engine.model.dtype"
    dim = head_dim(text)
    if cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if dim is not None and dim not in sizes:
            yield (
                f"{config_path}.backend",
                f"vLLM's CPU attention has kernels for heads of {sizes} dimensions; this model's have {dim} "
                f"(hidden_size / num_attention_heads in config.json): use rollout.backend=hf",
            )
            return
        supported = [name for name, dtype in DTYPES.items() if dtype in current_platform.supported_dtypes]
        if model.dtype not in supported:
            yield (
                dtype_key,
                f"vLLM runs {', '.join(supported)} on this {current_platform.get_cpu_architecture().name} CPU, "
                f"not {model.dtype}: set {config_path}.dtype to one of them",
            )
            return
    else:
        try:
            current_platform.check_if_supports_dtype(DTYPES[model.dtype])
        except ValueError as error:
            yield dtype_key, f"vLLM refuses {model.dtype} on this GPU: {error}"
            return
    yield from _engine_config(options, key, config_path, cpu, model, min(longest, positions or longest))


def _engine_config(
    options: VLLMRolloutConfig, key: str, config_path: str, cpu: bool, model: Any, max_model_len: int
) -> Iterator[tuple[str, str]]:
    """vLLM's own resolution of the engine's config: the model's architecture among them."""
    import torch

    from verl_vllm.engine import caller_state_kept

    try:
        from vllm.engine.arg_utils import EngineArgs

        args = EngineArgs(
            model=str(model.path),
            dtype=model.dtype,
            trust_remote_code=model.trust_remote_code,
            skip_tokenizer_init=True,
            max_model_len=options.max_model_len or max_model_len,
            enforce_eager=True,
            **engine_kwargs_for(options, cpu),
        )
    except TypeError as error:  # a name EngineArgs does not take
        yield f"{key}.engine_kwargs", f"vLLM's EngineArgs refuses them: {error}"
        return
    try:
        with caller_state_kept(torch.device("cpu"), {"HF_HUB_OFFLINE": "1"}):
            engine_config = args.create_engine_config()
    except Exception as error:  # vLLM's own refusal, its message says what and why
        message = " ".join(str(error).split())
        # An unknown architecture's message lists the hundreds vLLM has.
        message = message.split(" Supported architectures:")[0]
        yield (
            f"{config_path}.backend",
            f"vLLM cannot serve the model at {model.path}: {message[:600]}; use rollout.backend=hf, or a "
            "model vLLM supports",
        )
        return
    runner = engine_config.model_config.runner_type
    if runner != "generate":
        architectures = engine_config.model_config.architectures
        yield (
            f"{config_path}.backend",
            f"vLLM runs the model at {model.path} ({', '.join(architectures)}) as a {runner} model, not a "
            "generative one: the rollout needs a causal language model",
        )
