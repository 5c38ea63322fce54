"""The options of the ``megatron`` backend (``engine.megatron`` in a config), and the checks of a
parallel layout against a model and a world size.

Light on purpose (attrs only, no torch, no megatron-core): core structures and validates these
options while a config loads, before any backend is imported. What needs the model's config or the
job's size (heads divisible by TP, layers by PP, ranks by TP x PP) is ``check_layout``, which the
engine calls at ``initialize()`` with every problem reported at once under its full path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from verl_core.config.validators import positive
from verl_core.errors import ConfigError

#: Where errors about the options point in a config, unless the engine says where its options sit.
OPTIONS_PATH = "engine.megatron"


@attrs.define
class MegatronConfig:
    """How megatron-core lays the model out: tensor (TP), pipeline (PP, optionally virtual) and data
    parallelism (the rest of the world: ``world_size / (TP x PP)``)."""

    #: Ranks that split every layer's matrices (attention heads and MLP columns).
    tensor_model_parallel_size: int = attrs.field(default=1, validator=positive)
    #: Ranks that each hold a consecutive stage of the layers.
    pipeline_model_parallel_size: int = attrs.field(default=1, validator=positive)
    #: Model chunks per pipeline rank (interleaved schedule); None: one. Needs PP > 1.
    virtual_pipeline_model_parallel_size: int | None = attrs.field(default=None, validator=positive)
    #: Split the activations of norms and dropout along the sequence across the TP ranks. Needs
    #: transformer-engine and TP > 1.
    sequence_parallel: bool = False
    #: Shard the optimiser state over the DP ranks (megatron's distributed optimiser, ZeRO-1).
    use_distributed_optimizer: bool = False
    #: The layer implementation: ``local`` (megatron-core's own modules, CPU and GPU),
    #: ``transformer_engine`` (fused TE modules, GPU only), ``auto`` (TE where it is installed).
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    #: Run megatron-core on a machine without CUDA (tests, development) by bridging its CUDA
    #: assumptions (``verl_megatron.cpu_bridge``); refused where CUDA is available.
    cpu_bridge: bool = False


#: The Hugging Face config keys ``check_layout`` reads.
HEADS, KV_HEADS, LAYERS = "num_attention_heads", "num_key_value_heads", "num_hidden_layers"


def check_layout(
    options: MegatronConfig,
    model: Mapping[str, Any],
    world_size: int,
    transformer_engine: bool,
    where: str = OPTIONS_PATH,
) -> None:
    """Refuse a layout that cannot split ``model`` (a Hugging Face config as a mapping) over
    ``world_size`` ranks, or that asks for what this machine lacks (``transformer_engine``: whether
    transformer-engine is importable): one ``ConfigError`` listing every problem with its fix."""
    tp = options.tensor_model_parallel_size
    pp = options.pipeline_model_parallel_size
    vpp = options.virtual_pipeline_model_parallel_size
    errors: list[tuple[str, str]] = []
    heads, kv_heads, layers = model[HEADS], model.get(KV_HEADS) or model[HEADS], model[LAYERS]
    for key, count in ((HEADS, heads), (KV_HEADS, kv_heads)):
        if count % tp:
            errors.append(
                (
                    f"{where}.tensor_model_parallel_size",
                    f"{tp} does not divide the model's {count} {key}: use one of {_divisors(count)}",
                )
            )
    chunks = pp * (vpp or 1)
    if layers % chunks:
        what = f"{pp} pipeline stages" if vpp is None else f"{pp} stages x {vpp} virtual chunks"
        errors.append(
            (
                f"{where}.pipeline_model_parallel_size",
                f"{what} do not divide the model's {layers} {LAYERS} evenly: use a pipeline size among "
                f"{_divisors(layers)} (times the virtual size)",
            )
        )
    if vpp is not None and pp == 1:
        errors.append(
            (
                f"{where}.virtual_pipeline_model_parallel_size",
                f"{vpp} virtual chunks need pipeline_model_parallel_size > 1 (the interleaved schedule "
                "runs over several stages): raise it, or unset this",
            )
        )
    if world_size % (tp * pp):
        errors.append(
            (
                f"{where}.tensor_model_parallel_size",
                f"TP {tp} x PP {pp} = {tp * pp} does not divide the {world_size} ranks of the job: the "
                f"data-parallel size is world_size / (TP x PP); use a product among {_divisors(world_size)}",
            )
        )
    if options.sequence_parallel and not transformer_engine:
        errors.append(
            (
                f"{where}.sequence_parallel",
                "needs transformer-engine (megatron-core's local layers do not split the sequence), which "
                "is not installed: install it on a GPU machine, or turn sequence_parallel off",
            )
        )
    elif options.sequence_parallel and tp == 1:
        errors.append(
            (
                f"{where}.sequence_parallel",
                "splits activations across the TP ranks and there is one: raise "
                "tensor_model_parallel_size, or turn sequence_parallel off",
            )
        )
    if options.transformer_impl == "transformer_engine" and not transformer_engine:
        errors.append(
            (
                f"{where}.transformer_impl",
                "'transformer_engine' is not installed here: install it (GPU machines), or use 'auto' or "
                "'local'",
            )
        )
    if errors:
        raise ConfigError(errors)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
