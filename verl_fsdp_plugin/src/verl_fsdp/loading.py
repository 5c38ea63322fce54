"""``load_on_rank0``: the weights read on DP rank 0 only, each rank receiving just its shards.

Rank 0 loads the model on the CPU as usual; every other rank builds it on the meta device (no
weights read, no memory). All of them shard it; the meta ranks then allocate their shards with
``to_empty``, uninitialised, and rank 0 broadcasts its tensors one at a time, every rank keeping its
own shard of each (so no rank but the first ever holds more than one full tensor). Buffers travel
the same way, those outside the state dict included: ``to_empty`` leaves the rotary ``inv_freq``
(``persistent=False``) as garbage, which moves the loss of a tiny model by only ~5e-5 and so passes
loose checks unnoticed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

#: A full tensor per parameter and buffer name, as rank 0 loaded them.
FullState = dict[str, torch.Tensor]


def full_state(module: torch.nn.Module) -> FullState:
    """Rank 0's tensors, taken before sharding: references, not copies (``fully_shard`` copies each
    parameter into its shards and leaves the loaded tensor as it was)."""
    return dict(tensors_to_load(module))


def tensors_to_load(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name, in one order on every rank."""
    return itertools.chain(module.named_parameters(), module.named_buffers())


def load_from_rank0(
    model: torch.nn.Module,
    state: FullState | None,
    group: dist.ProcessGroup,
    device: torch.device,
    shards_on_cpu: bool = False,
) -> None:
    """Fill the sharded ``model`` on every rank of ``group`` from ``state`` (DP rank 0's
    ``full_state``, emptied on the way; None on the other ranks, whose ``model`` was built on the
    meta device).
    ``device`` is where the model computes; ``shards_on_cpu`` says its shards live on the CPU
    (``cpu_offload``), buffers staying on ``device``.

    A collective: every rank of ``group`` calls it, in the same parameter and buffer order.
    """
    if state is None:
        model.to_empty(device="cpu" if shards_on_cpu else device)
        if shards_on_cpu:
            for module in model.modules():
                for key, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[key] = buffer.to(device)
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for name, tensor in tensors_to_load(model):
            # Broadcast on the compute device: NCCL reduces device tensors only.
            if state is None:
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            else:  # dropped from ``state`` once sent: rank 0 frees its full copy as the shards fill
                full = state.pop(name).to(device)
            dist.broadcast(full, src=source, group=group)
            if isinstance(tensor, DTensor):
                # Every rank holds the full tensor now: each cuts out its own shard, no more traffic.
                shard = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(shard.to_local())
            else:
                tensor.copy_(full)
            del full
