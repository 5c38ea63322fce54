"""Dispatch by the engine's topology: which rows of a batch go to which rank, and how results come back.

A worker group's ranks report their ``Topology`` (DP rank, DP size, whether they own outputs). A batch
is split over the DP size, not the world size: each DP shard goes to every rank with that DP rank (the
tensor- and pipeline-parallel ranks of one model replica see the same shard), and outputs are taken
from the ranks that own them, one per DP rank. Sequences are balanced across DP ranks by length, so
that no rank waits for the one holding all the long responses.

Three kinds of split, by what the work needs:

- an update needs equal shards (every rank steps through the same mini-batches together): a batch
  that does not divide is refused at the config key that sets its size (``split_batch``);
- a forward pass with per-row results (log-probs, values) runs every rank of a DP group through the
  same micro-batches and collectives: any batch is filled up to a multiple of the DP size with copies
  of its first rows (``filled_rows``), split into equal shards, and the copies' results dropped;
- generation has no collective across DP ranks: any number of prompts is split into contiguous
  shares whose sizes differ by at most one (``contiguous_shards``); a rank with none skips it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from verl_core.data.batch import ATTENTION_MASK, UID
from verl_core.deprecation import moved_names
from verl_core.engine.topology import Topology
from verl_core.errors import ConfigError


def check_divisible(counts: Mapping[str, tuple[int, str]], dp_size: int) -> None:
    """Refuse what cannot be split evenly over the DP ranks. ``counts`` maps the config key that sets
    a count to the count and how to say it ("8 prompts x rollout.n=2 = 16 responses"); one
    ``ConfigError`` names every key that does not divide. The rule of the splits that need equal
    shards: an update's batch and its mini-batches, and SFT batches."""
    errors = [
        (
            key,
            f"{what} cannot be split evenly over {dp_size} data-parallel ranks (trainer.world_size divided "
            f"by the engine's model-parallel sizes): make it a multiple of {dp_size}",
        )
        for key, (count, what) in counts.items()
        if count % dp_size
    ]
    if errors:
        raise ConfigError(errors)


def balanced_shards(
    lengths: Sequence[int], dp_size: int, groups: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Row indices per DP rank: equal counts (``len(lengths)`` must divide: callers refuse or fill
    what does not), with the total length of each shard as even as a snake order over the rows sorted
    by length makes it. Each shard keeps its rows in batch order.

    With ``groups`` (a group id per row: the samples of one prompt, ``UID``), whole groups go to a
    rank, so that an engine sharing prompts (``micro_batch.share_prompts``) computes each prompt once
    rather than once per rank holding part of its group; the snake runs over the groups by their total
    length. That needs groups of one size whose count divides by ``dp_size`` (GRPO's); otherwise rows
    are balanced one by one."""
    if len(lengths) % dp_size:
        raise ValueError(f"{len(lengths)} rows do not make {dp_size} equal shards")
    units = [[row] for row in range(len(lengths))]
    if groups is not None:
        members: dict[int, list[int]] = {}
        for row, group in enumerate(groups):
            members.setdefault(group, []).append(row)
        if len({len(rows) for rows in members.values()}) == 1 and len(members) % dp_size == 0:
            units = list(members.values())
    weights = [sum(lengths[row] for row in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda i: -weights[i])
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for position, unit in enumerate(order):
        lap, offset = divmod(position, dp_size)
        shards[offset if lap % 2 == 0 else dp_size - 1 - offset].extend(units[unit])
    return [torch.tensor(sorted(shard), dtype=torch.long) for shard in shards]


def row_groups(batch: TensorDict) -> list[int] | None:
    """The batch's prompt groups (``UID``), where it has them."""
    return batch[UID].tolist() if UID in batch.keys() else None


def split_batch(batch: TensorDict, dp_size: int, size_key: str, balance: bool = True) -> list[torch.Tensor]:
    """Row indices of each DP rank's equal shard of ``batch``: balanced by sequence length, or
    contiguous. A batch that does not divide is refused at ``size_key``, the config key that sets
    its size (the caller's: ``data.train_batch_size`` for a step's update)."""
    rows = batch.batch_size[0]
    check_divisible({size_key: (rows, f"{rows} rows")}, dp_size)
    if not balance:
        return list(torch.arange(rows).tensor_split(dp_size))
    return balanced_shards(batch[ATTENTION_MASK].sum(dim=-1).tolist(), dp_size, row_groups(batch))


def filled_rows(rows: int, dp_size: int) -> torch.Tensor:
    """The rows of a batch of ``rows``, then copies of its first rows up to a multiple of ``dp_size``
    (``arange(filled) % rows``): a batch of any size as equal shards, none empty. The copies' results
    are dropped (the first ``rows`` of the restored results are the batch's)."""
    if rows < 1:
        raise ValueError("a batch to split over data-parallel ranks needs at least one row")
    return torch.arange(-(-rows // dp_size) * dp_size) % rows


def contiguous_shards(rows: int, dp_size: int) -> list[torch.Tensor]:
    """Row indices per DP rank for work without collectives across DP ranks (generation): contiguous,
    in row order, their sizes differing by at most one (empty for the last ranks when there are fewer
    rows than ranks)."""
    return list(torch.arange(rows).tensor_split(dp_size))


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
    {"check_topologies": "verl_core.engine:check_topologies"},
    since="0.2.0",
    removed_in="0.4.0",
)
