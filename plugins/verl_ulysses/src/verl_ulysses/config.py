"""The options of the ``ulysses`` backend (``engine.ulysses`` in a config), and the check of a layout
against a model and a job.

Light on purpose (attrs only, no torch): core structures and validates these options while a config
loads, before any backend is imported. What needs the model's config or the job's size (attention
heads divisible by the SP size, KV heads dividing or divisible by it, ``dp x sp`` equal to the world)
is ``check_layout``, with every problem reported at once under its full path: core runs it before any
worker starts (``UlyssesEngine.check_before_start``, with the model's config.json and the run's world
size), and the engine again at the start of ``initialize()``, before any process group is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
from verl_core.config.validators import positive
from verl_core.errors import ConfigError

#: Where errors about the options point in a config, unless the engine says where its options sit.
OPTIONS_PATH = "engine.ulysses"

#: Names of the floating-point dtypes FSDP may compute or reduce in (those of ``model.dtype``).
DtypeName = Literal["float32", "bfloat16", "float16"]


@attrs.define
class UlyssesConfig:
    """The parallel plan: a ``(dp_replicate, dp_shard, sp)`` mesh over the job's ranks.

    Parameters are sharded by FSDP2 over ``dp_shard x sp`` (and replicated over ``dp_replicate``);
    each data-parallel rank (``dp_replicate x dp_shard`` of them) gets its own share of every batch,
    which its ``sp`` ranks split along the sequence (DeepSpeed-Ulysses: an all-to-all around
    attention).
    """

    #: Ulysses sequence-parallel size: ranks that split each micro-batch's tokens between them and
    #: exchange attention heads. Must divide the model's attention heads; the KV heads must divide it
    #: or be divisible by it (fewer KV heads than ``sp_size`` are repeated).
    sp_size: int = attrs.field(default=1, validator=positive)
    #: Ranks that hold different data and split the parameters between them. None: what is left of
    #: the world, ``world_size / (dp_replicate_size x sp_size)``.
    dp_shard_size: int | None = attrs.field(default=None, validator=positive)
    #: Groups of ``dp_shard_size x sp_size`` ranks that each hold a full copy of the sharded model
    #: (HSDP: gradients reduce-scattered within a group, all-reduced across the groups).
    dp_replicate_size: int = attrs.field(default=1, validator=positive)
    #: Free each decoder layer's gathered parameters after its forward and gather them again for
    #: backward (less memory, one more all-gather per layer). The root keeps them until backward.
    reshard_after_forward: bool = True
    #: Dtype of the gathered parameters the forward and backward compute in (mixed precision); the
    #: sharded parameters and AdamW stay in ``model.dtype``. None: ``model.dtype``.
    param_dtype: DtypeName | None = None
    #: Dtype gradients are reduced in. None: ``param_dtype``.
    reduce_dtype: DtypeName | None = None


#: The Hugging Face config keys ``check_layout`` reads.
HEADS, KV_HEADS = "num_attention_heads", "num_key_value_heads"


@attrs.frozen
class MeshShape:
    """The sizes of the mesh's dimensions: ``dp_replicate x dp_shard x sp`` ranks."""

    dp_replicate: int
    dp_shard: int
    sp: int

    @property
    def dp(self) -> int:
        """The data-parallel size: how many shares every batch is split into."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.sp


def check_layout(
    options: UlyssesConfig, model: Mapping[str, Any], world_size: int, where: str = OPTIONS_PATH
) -> MeshShape:
    """The mesh ``options`` lay ``world_size`` ranks out in, or one ``ConfigError`` listing every reason
    they cannot split ``model`` (a Hugging Face config as a mapping) over the job, each with its fix."""
    sp, replicate = options.sp_size, options.dp_replicate_size
    errors: list[tuple[str, str]] = []
    heads = model[HEADS]
    kv_heads = model.get(KV_HEADS) or heads
    # The SP sizes this model admits: they divide the heads, and divide or are divisible by the KV heads.
    fitting = [n for n in _divisors(heads) if kv_heads % n == 0 or n % kv_heads == 0]
    if heads % sp:
        errors.append(
            (
                f"{where}.sp_size",
                f"{sp} does not divide the model's {heads} {HEADS}: each SP rank attends with "
                f"{HEADS} / sp_size of them; use one of {fitting}",
            )
        )
    if kv_heads % sp and sp % kv_heads:
        errors.append(
            (
                f"{where}.sp_size",
                f"{sp} and the model's {kv_heads} {KV_HEADS} do not divide one another: the KV heads are "
                f"split over the SP ranks, or repeated when there are fewer of them than SP ranks; use one "
                f"of {fitting}",
            )
        )
    shard = options.dp_shard_size
    if shard is None:
        if world_size % (replicate * sp):
            errors.append(
                (
                    f"{where}.sp_size",
                    f"sp_size {sp} x dp_replicate_size {replicate} = {sp * replicate} does not divide the "
                    f"{world_size} ranks of the job (the data-parallel size is what is left of them): use "
                    f"a product among {_divisors(world_size)}",
                )
            )
        else:
            shard = world_size // (replicate * sp)
    elif replicate * shard * sp != world_size:
        errors.append(
            (
                f"{where}.dp_shard_size",
                f"dp_replicate_size {replicate} x dp_shard_size {shard} x sp_size {sp} = "
                f"{replicate * shard * sp}, but the job has {world_size} ranks: the mesh must cover "
                f"every rank once; set dp_shard_size to {world_size // (replicate * sp) or 'a size that fits'}"
                " or leave it unset",
            )
        )
    if errors:
        raise ConfigError(errors)
    return MeshShape(replicate, shard, sp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
