"""Small collectives over an optional process group, usable with or without ``torch.distributed``.

Every helper treats ``group=None`` (or an uninitialised ``torch.distributed``) as a single process,
so engines and the micro-batch loop run unchanged in one process and in a DP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_max", "all_reduce_sum", "barrier", "collective_device", "group_rank", "group_size"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 without a distributed group."""
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 without a distributed group."""
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where tensors for collectives on ``group`` must live: the current CUDA device for NCCL."""
    if group is not None and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The element-wise maximum of ``values`` over ``group`` (one collective for all of them)."""
    if group_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in tensor.tolist()]


def all_reduce_sum(value: float, group: dist.ProcessGroup | None) -> float:
    """The sum of ``value`` over ``group`` (in float64)."""
    if group_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, group=group)
    return float(tensor.item())


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every rank of ``group``."""
    if group_size(group) > 1:
        dist.barrier(group=group)
