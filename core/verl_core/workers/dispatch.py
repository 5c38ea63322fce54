"""Dispatch by the engine's topology: which rows of a batch go to which rank, and how results come back.

A worker group's ranks report their ``Topology`` (DP rank, DP size, whether they own outputs). A batch
is split over the DP size, not the world size: each DP shard goes to every rank with that DP rank (the
tensor- and pipeline-parallel ranks of one model replica see the same shard), and outputs are taken
from the ranks that own them, one per DP rank. Sequences are balanced across DP ranks by length, so
that no rank waits for the one holding all the long responses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from verl_core.data.batch import ATTENTION_MASK
from verl_core.deprecation import moved_names
from verl_core.engine.topology import Topology
from verl_core.errors import ConfigError


def balanced_shards(lengths: Sequence[int], dp_size: int) -> list[torch.Tensor]:
    """Row indices per DP rank: equal counts (the batch must divide), with the total length of each
    shard as even as a snake order over the rows sorted by length makes it. Each shard keeps its rows
    in batch order."""
    if len(lengths) % dp_size:
        raise ConfigError(
            [
                (
                    "data.train_batch_size",
                    f"{len(lengths)} sequences cannot be split evenly over {dp_size} data-parallel ranks: make "
                    "the sequences of a step (prompts x rollout.n for RL, data.train_batch_size for SFT) a "
                    "multiple of the data-parallel size (trainer.world_size)",
                )
            ]
        )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for position, row in enumerate(order):
        lap, offset = divmod(position, dp_size)
        shards[offset if lap % 2 == 0 else dp_size - 1 - offset].append(row)
    return [torch.tensor(sorted(shard), dtype=torch.long) for shard in shards]


def split_batch(batch: TensorDict, dp_size: int, balance: bool = True) -> list[torch.Tensor]:
    """Row indices of each DP rank's shard of ``batch``: balanced by sequence length, or contiguous."""
    if not balance:
        if batch.batch_size[0] % dp_size:
            raise ConfigError(
                [
                    (
                        "data.train_batch_size",
                        f"{batch.batch_size[0]} rows cannot be split evenly over {dp_size} DP ranks",
                    )
                ]
            )
        return list(torch.arange(batch.batch_size[0]).chunk(dp_size))
    return balanced_shards(batch[ATTENTION_MASK].sum(dim=-1).tolist(), dp_size)


def shards_for_ranks(shards: Sequence[object], topologies: Sequence[Topology]) -> list[object]:
    """What each rank receives: the shard of its DP rank."""
    return [shards[t.dp_rank] for t in topologies]


def gather_outputs(results: Sequence[object], topologies: Sequence[Topology]) -> list[object]:
    """The results of the output ranks, in DP-rank order."""
    by_dp_rank = {
        t.dp_rank: result for result, t in zip(results, topologies, strict=True) if t.is_output_rank
    }
    return [by_dp_rank[dp_rank] for dp_rank in range(len(by_dp_rank))]


def restore_order(parts: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-shard results (rows in each shard's order) put back into the batch's row order."""
    merged = torch.cat(list(parts), dim=0)
    index = torch.cat(list(shards))
    restored = torch.empty_like(merged)
    restored[index] = merged
    return restored


__getattr__ = moved_names(
    __name__,
    {"check_topologies": "verl_core.engine.topology:check_topologies"},
    since="0.2.0",
    removed_in="0.4.0",
)
