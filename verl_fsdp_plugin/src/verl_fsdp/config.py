"""The options of the ``fsdp`` backend (``engine.fsdp`` in a config, ``engine.options`` in Python).

Light on purpose (attrs only, no torch): core structures and validates these options while a
config loads, before any backend is imported.
"""

from __future__ import annotations

from typing import Literal

import attrs

from verl_core.config.validators import InvalidValue, positive

#: Names of the floating-point dtypes FSDP may compute or reduce in (those of ``model.dtype``).
DtypeName = Literal["float32", "bfloat16", "float16"]


def _class_names(instance: FSDPConfig, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    bad = [name for name in value if not (isinstance(name, str) and name.isidentifier())]
    if bad:
        raise InvalidValue(
            attribute.name,
            f"{bad} are not module class names; name classes such as 'Qwen2DecoderLayer', or leave the "
            "list empty for the model's decoder layers",
        )


@attrs.define
class FSDPConfig:
    """How ``torch.distributed.fsdp.fully_shard`` (FSDP2) lays the model out over the DP group.

    Every module whose class is in ``shard_modules`` becomes its own FSDP unit (parameters
    all-gathered before its forward, gradients reduce-scattered after its backward), then the root
    module takes the remaining parameters (embeddings, final norm, output head).
    """

    #: Free each unit's gathered parameters after its forward and gather them again for backward:
    #: saves memory, costs one more all-gather per unit and step. The root unit always keeps them
    #: until backward, which needs them at once; the engine reshards everything after inference.
    reshard_after_forward: bool = True
    #: Dtype of the gathered parameters the forward and backward compute in (mixed precision); the
    #: sharded parameters and the optimiser stay in ``model.dtype``. None: ``model.dtype``.
    param_dtype: DtypeName | None = None
    #: Dtype gradients are reduce-scattered in. None: ``param_dtype``. Use ``float32`` with
    #: ``param_dtype: bfloat16`` for accurate gradient averaging.
    reduce_dtype: DtypeName | None = None
    #: Keep sharded parameters, gradients and optimiser state on the CPU (``CPUOffloadPolicy``) and
    #: step the optimiser there; each unit is copied to the device for its forward and backward.
    #: On CUDA the process group must have a CPU backend too (``backend="cpu:gloo,cuda:nccl"``).
    cpu_offload: bool = False
    #: Class names of the modules that become FSDP units. Empty: the model's own
    #: ``_no_split_modules`` (its decoder layers, e.g. ``Qwen2DecoderLayer``).
    shard_modules: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_class_names)
    #: Hybrid sharding (HSDP): shard within groups of this many DP ranks and replicate across the
    #: groups (a 2-D ``("replicate", "shard")`` mesh; gradients are reduce-scattered within a group,
    #: then all-reduced across groups). Must divide the DP size. None: shard across all DP ranks.
    shard_size: int | None = attrs.field(default=None, validator=positive)
    #: Load the weights on DP rank 0 only: the other ranks build the model on the meta device and
    #: receive their shards (and the buffers the checkpoint lacks, such as the rotary ``inv_freq``)
    #: from rank 0, so no rank but the first holds a full copy of the model.
    load_on_rank0: bool = False
    #: Keep each unit's parameters gathered from their first all-gather in a step to the step's last
    #: backward, instead of gathering them again for every micro-batch: fewer collectives, at the
    #: cost of the full parameters resident during the step (as without sharding).
    keep_params_gathered: bool = False
