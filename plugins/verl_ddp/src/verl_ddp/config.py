"""The options of the ``ddp`` backend (``engine.options`` in a config)."""

from __future__ import annotations

import attrs


@attrs.define
class DDPConfig:
    """Options passed to ``torch.nn.parallel.DistributedDataParallel`` (used at world size > 1)."""

    #: Gradients are all-reduced in buckets of this many MiB, overlapping communication with backward.
    bucket_cap_mb: float = attrs.field(default=25.0, validator=attrs.validators.gt(0))
    #: Needed when some parameters get no gradient in a step (costs a graph traversal per step).
    find_unused_parameters: bool = False
    #: Gradients alias the all-reduce buckets, saving one copy of the gradients in memory.
    gradient_as_bucket_view: bool = True
    #: Re-broadcast buffers from rank 0 before every forward (they are always synced once at start);
    #: the models' buffers (rotary frequencies) never change, so off.
    forward_sync_buffers: bool = False
    #: Declare the graph identical every step, which lets DDP skip per-step bookkeeping.
    static_graph: bool = False
