"""Micro-batching: split one rank's batch into micro-batches, and put outputs back in batch order.

Two modes (``MicroBatchConfig``): a fixed number of sequences per micro-batch, or a token budget
(``use_dynamic_bsz``) that counts ``attention_mask`` tokens and packs sequences into balanced
micro-batches. Where a packed micro-batch computes a shared prompt once (``packing`` and
``share_prompts``), the budget keeps the samples of one prompt together and counts the tokens
computed: the prompt once, then every sample's response. Under data parallelism every rank must run
the same number of backward passes (DDP and FSDP synchronise gradients per backward), so the count
is the maximum over the DP group.

Token-budget micro-batches regroup sequences; ``MicroBatchSplit.restore`` undoes that on outputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TypeVar

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from verl_core.config.engine import MicroBatchConfig
from verl_core.data.batch import ATTENTION_MASK, INPUT_IDS, RESPONSES, prompt_groups, select_rows
from verl_core.distributed import all_reduce_max

T = TypeVar("T", torch.Tensor, TensorDict)


@attrs.frozen
class MicroBatchSplit:
    """Micro-batches of one batch, and how to restore the batch order of their concatenated outputs.

    ``indices[i]`` holds the batch positions of micro-batch ``i``; ``restore_index`` is the permutation
    with ``torch.cat(outputs)[restore_index]`` in batch order.
    """

    micro_batches: list[TensorDict]
    indices: list[torch.Tensor]
    restore_index: torch.Tensor

    def restore(self, outputs: Sequence[T]) -> T:
        """Concatenate per-micro-batch outputs (along dim 0) and put them back in batch order."""
        if len(outputs) != len(self.micro_batches):
            raise ValueError(f"expected {len(self.micro_batches)} micro-batch outputs, got {len(outputs)}")
        merged = torch.cat(list(outputs), dim=0)
        return merged[self.restore_index.to(merged.device)]


def split_micro_batches(
    batch: TensorDict, config: MicroBatchConfig, dp_group: dist.ProcessGroup | None = None
) -> MicroBatchSplit:
    """Split ``batch`` (this rank's share) into micro-batches as ``config`` says.

    With ``dp_group``, all ranks of the group end up with the same number of micro-batches (this
    is a collective: every rank of the group must call it).
    """
    num_seqs = batch.batch_size[0]
    if config.use_dynamic_bsz:
        units = budget_units(batch, config)
        local_count = len(partition_by_token_budget([unit.tokens for unit in units], config.max_token_len))
    else:
        local_count = math.ceil(num_seqs / config.micro_batch_size)

    # One collective for the group's micro-batch count and its fewest sequences (as a negated max),
    # so that every rank raises together instead of one rank leaving the others hanging.
    count, negated_fewest = all_reduce_max([local_count, -num_seqs], dp_group)
    fewest = -negated_fewest
    if fewest == 0:
        raise ValueError("cannot split an empty batch into micro-batches: every rank needs sequences")
    if count > fewest:
        raise ValueError(
            f"a rank of the data-parallel group has {fewest} sequence(s) but the group needs "
            f"{count} micro-batches (every rank runs the same number of backward passes): give every "
            "rank at least as many sequences as the busiest rank's micro-batch count, e.g. balance the "
            "batch across ranks or raise micro_batch.max_token_len / micro_batch_size"
        )

    if config.use_dynamic_bsz:
        units = at_least(units, count)
        bins = partition_by_token_budget(
            [unit.tokens for unit in units], config.max_token_len, num_groups=count
        )
        indices = [
            torch.tensor(sorted(row for i in bin_ for row in units[i].rows), dtype=torch.long)
            for bin_ in bins
        ]
    else:
        indices = list(torch.arange(num_seqs).tensor_split(count))
    restore_index = torch.argsort(torch.cat(indices))
    return MicroBatchSplit([select_rows(batch, index) for index in indices], indices, restore_index)


@attrs.frozen
class BudgetUnit:
    """Rows a token budget places together, and the tokens they compute: a row alone, or the samples of
    one prompt whose packed micro-batch computes the prompt once (``prompt`` tokens, then each row's
    ``responses`` tokens)."""

    rows: tuple[int, ...]
    prompt: int
    responses: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.prompt + sum(self.responses)

    def halves(self) -> list[BudgetUnit]:
        middle = len(self.rows) // 2
        return [
            BudgetUnit(self.rows[part], self.prompt, self.responses[part])
            for part in (slice(None, middle), slice(middle, None))
        ]


def budget_units(batch: TensorDict, config: MicroBatchConfig) -> list[BudgetUnit]:
    """What the token budget places: each row alone (its ``attention_mask`` tokens), or, where the
    engine shares prompts, the rows of each prompt together, split into pieces of at most the budget."""
    lengths = batch[ATTENTION_MASK].sum(dim=-1).tolist()
    keys = batch.keys()
    if not (config.packing and config.share_prompts is not False and INPUT_IDS in keys and RESPONSES in keys):
        return [BudgetUnit((row,), length, ()) for row, length in enumerate(lengths)]
    response_width = batch[RESPONSES].shape[-1]
    responses = batch[ATTENTION_MASK][:, -response_width:].sum(dim=-1).tolist()
    members: dict[int, list[int]] = {}
    for row, group in enumerate(
        prompt_groups(batch[INPUT_IDS], batch[ATTENTION_MASK], response_width).tolist()
    ):
        members.setdefault(group, []).append(row)
    units = []
    for rows in members.values():
        prompt = lengths[rows[0]] - responses[rows[0]]
        piece: list[int] = []
        for row in rows:  # a piece grows until the next response would take it past the budget
            if piece and prompt + sum(responses[r] for r in piece) + responses[row] > config.max_token_len:
                units.append(BudgetUnit(tuple(piece), prompt, tuple(responses[r] for r in piece)))
                piece = []
            piece.append(row)
        units.append(BudgetUnit(tuple(piece), prompt, tuple(responses[r] for r in piece)))
    return units


def at_least(units: list[BudgetUnit], count: int) -> list[BudgetUnit]:
    """``units`` split until there are ``count`` (more micro-batches than whole groups, as another DP
    rank needs): the largest group in halves, in turn. ``count`` is at most the rows."""
    units = list(units)
    while len(units) < count:
        largest = max((unit for unit in units if len(unit.rows) > 1), key=lambda unit: unit.tokens)
        units.remove(largest)
        units += largest.halves()
    return units


def partition_by_token_budget(
    lengths: Sequence[int], budget: int, num_groups: int | None = None
) -> list[list[int]]:
    """Partition sequence positions into balanced groups whose total length stays within ``budget``.

    A sequence longer than ``budget`` gets a group of its own. Without ``num_groups``, uses the
    fewest groups it can find; with it, exactly ``num_groups`` non-empty groups (at most
    ``len(lengths)``, and at least the fewest needed).
    """
    if not lengths:
        return []
    if num_groups is None:
        # Each group holds at most ``budget`` tokens, except single oversized sequences.
        num_groups = max(1, math.ceil(sum(min(n, budget) for n in lengths) / budget))
        while (groups := _longest_first(lengths, num_groups)) is None or not _fits(groups, lengths, budget):
            num_groups += 1
        return groups
    if not 1 <= num_groups <= len(lengths):
        raise ValueError(f"num_groups={num_groups}: expected between 1 and {len(lengths)} (the sequences)")
    groups = _longest_first(lengths, num_groups)
    if groups is not None and _fits(groups, lengths, budget):
        return groups
    # Longest-first is not monotone in the group count: split the fewest-group partition instead,
    # which keeps every group within budget (a subset of a group that fits also fits).
    groups = partition_by_token_budget(lengths, budget)
    if len(groups) > num_groups:
        raise ValueError(f"num_groups={num_groups}: {len(groups)} groups are needed for budget {budget}")
    while len(groups) < num_groups:
        largest = max((g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g))
        groups.remove(largest)
        groups.extend(_longest_first([lengths[i] for i in largest], 2, labels=largest))
    return groups


def _longest_first(
    lengths: Sequence[int], num_groups: int, labels: Sequence[int] | None = None
) -> list[list[int]] | None:
    """Greedy balanced partition: longest sequence first into the least-loaded group.

    Returns ``None`` when a group would stay empty (more groups than sequences)."""
    if num_groups > len(lengths):
        return None
    labels = range(len(lengths)) if labels is None else labels
    # Heap of (load, size, group id): ties go to the group with fewer sequences, so none stays empty.
    heap = [(0, 0, g) for g in range(num_groups)]
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    for position in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, size, g = heapq.heappop(heap)
        groups[g].append(labels[position])
        heapq.heappush(heap, (load + lengths[position], size + 1, g))
    return groups


def _fits(groups: list[list[int]], lengths: Sequence[int], budget: int) -> bool:
    return all(len(g) == 1 or sum(lengths[i] for i in g) <= budget for g in groups)
