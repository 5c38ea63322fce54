"""The job's ranks laid out as a ``(dp_replicate, dp_shard, sp)`` mesh, and its process groups.

Rank ``r`` sits at ``(r // (dp_shard * sp), r // sp % dp_shard, r % sp)``: the ``sp`` ranks of one
data-parallel rank are consecutive (on one node, where the all-to-all inside every attention layer is
cheapest). Three kinds of groups come out of it:

- the **SP group** of a DP rank: its ``sp`` consecutive ranks, which split one micro-batch's tokens;
- the **DP group** of an SP rank: the ranks holding the same SP rank of every DP rank (``r % sp``
  equal), which is what the engine reports as ``dp_group``: it excludes the other SP ranks, so a
  loss normalised over it counts each token once;
- the **FSDP mesh**: every rank, sharding over ``dp_shard x sp`` (1-D), or ``(dp_replicate, dp_shard
  x sp)`` for HSDP (replicated over the first dimension, sharded over the second).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from verl_ulysses.config import MeshShape


@attrs.frozen
class ParallelMesh:
    """This rank's place in the mesh and the groups it belongs to."""

    shape: MeshShape
    rank: int
    #: The ranks that split this rank's micro-batches along the sequence (None at ``sp == 1``).
    sp_group: dist.ProcessGroup | None
    #: The ranks of every DP rank that hold this rank's SP rank.
    dp_group: dist.ProcessGroup
    #: What FSDP shards (and replicates) the parameters over.
    fsdp_mesh: DeviceMesh

    @property
    def sp_rank(self) -> int:
        return self.rank % self.shape.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.shape.sp


def build_mesh(shape: MeshShape, device_type: str) -> ParallelMesh:
    """The groups of ``shape`` over the world group. A collective: every rank of the job calls it,
    in the same order relative to its other group creations."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if shape.world_size != world:  # check_layout's job; a bug if it happens here
        raise ValueError(f"a mesh of {shape.world_size} ranks for a job of {world}")
    ranks = torch.arange(world).view(shape.dp, shape.sp)
    sp_group = None
    if shape.sp > 1:
        sp_group, _ = dist.new_subgroups_by_enumeration(ranks.tolist())
    if shape.sp == 1:
        dp_group = dist.group.WORLD
    else:
        dp_group, _ = dist.new_subgroups_by_enumeration(ranks.T.tolist())
    if shape.dp_replicate == 1:
        fsdp_mesh = DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("dp_shard_sp",))
    else:
        fsdp_mesh = DeviceMesh(
            device_type,
            torch.arange(world).view(shape.dp_replicate, shape.dp_shard * shape.sp),
            mesh_dim_names=("dp_replicate", "dp_shard_sp"),
        )
    return ParallelMesh(shape, rank, sp_group, dp_group, fsdp_mesh)
