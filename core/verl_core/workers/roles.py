"""The trainer's typed view of each role: whole batches in, whole, materialised results out.

``Actor``, ``Critic`` and ``SFT`` wrap a ``WorkerGroup`` of ``ActorWorker`` / ``CriticWorker`` /
``SFTWorker`` ranks (``verl_core.workers.ranks``), calling their methods by reference. They split
every batch by the engines' topology (``verl_core.workers.dispatch``), call every rank, and return
tensors in the batch's row order, so the trainer never sees a rank, a shard or a future. Generation
and per-row forward passes take any number of rows; an update needs equal shards, and a batch that
does not divide is refused at the config key its caller names (the one that sets the batch's size).
A role without a critic simply has no ``Critic``; the reference policy lives inside the actor and is
asked for through ``Actor.compute_ref_log_probs``, which refuses clearly when no KL term built one.
Distillation teachers live inside the actor too (``Actor.compute_teacher_outputs``), or over ranks of
their own (``Teacher``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from tensordict import TensorDict

from verl_core.config.paths import absolute_path
from verl_core.data.batch import ATTENTION_MASK, concat_batches, select_rows
from verl_core.engine.topology import Topology, check_topologies
from verl_core.rollout.base import SamplingParams
from verl_core.seeds import derive_seed
from verl_core.workers.dispatch import (
    balanced_shards,
    contiguous_shards,
    filled_rows,
    gather_outputs,
    restore_order,
    row_groups,
    shards_for_ranks,
    split_batch,
)
from verl_core.workers.group import WorkerGroup
from verl_core.workers.ranks import ActorWorker, CriticWorker, SFTWorker, TeacherWorker
from verl_core.workers.replicas import PublishedWeights


class Role:
    """The driver-side handle on one role's worker group: the ranks' topologies and their dp size.
    ``worker_class`` is the class of its ranks, whose methods it calls."""

    worker_class: ClassVar[type]

    def __init__(self, group: WorkerGroup):
        self.group = group
        self.topologies: list[Topology] = group.call(self.worker_class.initialize)
        self.dp_size = check_topologies(self.topologies, group.role)

    def _per_row(self, method: Callable[..., Any], batch: TensorDict, *extra: object) -> torch.Tensor:
        """``method`` on each DP shard of ``batch``, a batch of any size; per-row results back in the
        batch's order. The ranks of a DP group run the same micro-batches and collectives, so the
        shards are equal: copies of the first rows fill the batch up to a multiple of the DP size, and
        their results are dropped."""
        rows = batch.batch_size[0]
        filled = select_rows(batch, filled_rows(rows, self.dp_size))
        shards = balanced_shards(
            filled[ATTENTION_MASK].sum(dim=-1).tolist(), self.dp_size, row_groups(filled)
        )
        args = [(select_rows(filled, shard), *extra) for shard in shards]
        results = self.group.call_each(method, shards_for_ranks(args, self.topologies))
        return restore_order(gather_outputs(results, self.topologies), shards)[:rows]

    def update(self, batch: TensorDict, num_mini_batches: int, size_key: str) -> dict[str, float]:
        """``num_mini_batches`` optimiser steps (per epoch) on ``batch``, split over the DP ranks in
        equal shards (every rank steps through the same mini-batches): a batch that does not divide is
        refused at ``size_key``, the config key that sets its size."""
        shards = split_batch(batch, self.dp_size, size_key)
        args = [(select_rows(batch, shard), num_mini_batches) for shard in shards]
        results = self.group.call_each(self.worker_class.update, shards_for_ranks(args, self.topologies))
        # Losses and gradient norms are global: every output rank reports the same numbers.
        return gather_outputs(results, self.topologies)[0]

    # Paths go to the ranks absolute: a rank's process may run in another folder (verl_core.config.paths).

    def save_checkpoint(self, path: str, global_step: int) -> None:
        self.group.call(self.worker_class.save_checkpoint, absolute_path(path), global_step)

    def load_checkpoint(self, path: str) -> int:
        (step, *others) = self.group.call(self.worker_class.load_checkpoint, absolute_path(path))
        return step

    def shutdown(self) -> None:
        self.group.shutdown()


class Actor(Role):
    """The policy, its rollout and (with a KL term) the reference policy, over the actor's ranks."""

    worker_class = ActorWorker

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        """One response per prompt, for any number of prompts (a multi-turn rollout's turn has as many
        as conversations are still going): each DP rank generates its contiguous share, the shares'
        sizes differing by at most one, seeded by ``seed`` and its DP rank (a rank with no share skips
        it: generation has no collective across DP ranks); the batch contract in prompt order."""
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        args = [
            ([prompts[i] for i in shard.tolist()], sampling, derive_seed("rollout", seed, dp))
            for dp, shard in enumerate(contiguous_shards(len(prompts), self.dp_size))
        ]
        results = self.group.call_each(ActorWorker.generate, shards_for_ranks(args, self.topologies))
        parts = [part for part in gather_outputs(results, self.topologies) if part is not None]
        return concat_batches(parts, sampling.pad_token_id)

    def compute_log_probs(self, batch: TensorDict) -> torch.Tensor:
        return self._per_row(ActorWorker.compute_log_probs, batch)

    def compute_ref_log_probs(self, batch: TensorDict) -> torch.Tensor:
        return self._per_row(ActorWorker.compute_ref_log_probs, batch)

    def compute_teacher_outputs(self, batch: TensorDict, name: str) -> TensorDict:
        """Distillation teacher ``name``'s scores of ``batch`` (placed in the actor's processes)."""
        return self._per_row(ActorWorker.compute_teacher_outputs, batch, name)

    def sync_weights(self) -> None:
        self.group.call(ActorWorker.sync_weights)

    def publish_weights(self) -> PublishedWeights:
        """The policy's weights on their way to separate rollout replicas (``ActorWorker.publish_weights``:
        checked buckets, in Ray's object store under Ray), gathered from the ranks."""
        return next(result for result in self.group.call(ActorWorker.publish_weights) if result is not None)

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (Hugging Face names, on the CPU), gathered from the ranks."""
        return next(result for result in self.group.call(ActorWorker.weights) if result is not None)

    def save_hf_model(self, path: str) -> None:
        self.group.call(ActorWorker.save_hf_model, absolute_path(path))


class Critic(Role):
    """The value model over the critic's ranks."""

    worker_class = CriticWorker

    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        return self._per_row(CriticWorker.compute_values, batch)


class Teacher(Role):
    """A distillation teacher over ranks of its own (``distillation.teachers.<name>.placement: separate``)."""

    worker_class = TeacherWorker

    def compute_outputs(self, batch: TensorDict) -> TensorDict:
        """The teacher's scores of ``batch`` (``verl_core.workers.ranks.teacher_outputs``)."""
        return self._per_row(TeacherWorker.compute_outputs, batch)


class SFT(Role):
    """The policy being fine-tuned, over the SFT role's ranks."""

    worker_class = SFTWorker

    def compute_loss(self, batch: TensorDict, size_key: str) -> dict[str, float]:
        """The batch's token-mean NLL, forward only; ``batch`` divides over the DP size like an update's
        (refused at ``size_key`` otherwise: fill it with rows whose ``response_mask`` is empty)."""
        shards = split_batch(batch, self.dp_size, size_key)
        results = self.group.call_each(
            SFTWorker.compute_loss,
            shards_for_ranks([(select_rows(batch, s),) for s in shards], self.topologies),
        )
        return gather_outputs(results, self.topologies)[0]  # a global loss: every output rank has it

    def save_hf_model(self, path: str) -> None:
        self.group.call(SFTWorker.save_hf_model, absolute_path(path))
