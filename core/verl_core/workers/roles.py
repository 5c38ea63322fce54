"""The trainer's typed view of each role: whole batches in, whole, materialised results out.

``Actor`` and ``Critic`` wrap a ``WorkerGroup`` of ``ActorWorker`` / ``CriticWorker`` ranks. They split
every batch by the engines' topology (``verl_core.workers.dispatch``), call every rank, and return
tensors in the batch's row order, so the trainer never sees a rank, a shard or a future. A role
without a critic simply has no ``Critic``; the reference policy lives inside the actor and is asked
for through ``Actor.compute_ref_log_probs``, which refuses clearly when no KL term built one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from verl_core.config.paths import absolute_path
from verl_core.data.batch import concat_batches
from verl_core.engine.topology import Topology, check_topologies
from verl_core.errors import ConfigError
from verl_core.rollout.base import SamplingParams
from verl_core.workers.dispatch import (
    gather_outputs,
    restore_order,
    shards_for_ranks,
    split_batch,
)
from verl_core.workers.group import WorkerGroup


class Role:
    """The driver-side handle on one role's worker group: the ranks' topologies and their dp size."""

    def __init__(self, group: WorkerGroup):
        self.group = group
        self.topologies: list[Topology] = group.call("initialize")
        self.dp_size = check_topologies(self.topologies, group.role)

    def _per_row(self, method: str, batch: TensorDict, *extra: object) -> torch.Tensor:
        """``method`` on each DP shard of ``batch``; per-row results back in the batch's order."""
        shards = split_batch(batch, self.dp_size)
        args = [(batch[shard], *extra) for shard in shards]
        results = self.group.call_each(method, shards_for_ranks(args, self.topologies))
        return restore_order(gather_outputs(results, self.topologies), shards)

    def _update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        shards = split_batch(batch, self.dp_size)
        args = [(batch[shard], num_mini_batches) for shard in shards]
        results = self.group.call_each("update", shards_for_ranks(args, self.topologies))
        # Losses and gradient norms are global: every output rank reports the same numbers.
        return gather_outputs(results, self.topologies)[0]

    # Paths go to the ranks absolute: a rank's process may run in another folder (verl_core.config.paths).

    def save_checkpoint(self, path: str, global_step: int) -> None:
        self.group.call("save_checkpoint", absolute_path(path), global_step)

    def load_checkpoint(self, path: str) -> int:
        (step, *others) = self.group.call("load_checkpoint", absolute_path(path))
        return step

    def shutdown(self) -> None:
        self.group.shutdown()


class Actor(Role):
    """The policy, its rollout and (with a KL term) the reference policy, over the actor's ranks."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, seed: int) -> TensorDict:
        """One response per prompt, each DP rank generating its contiguous share (seeded by ``seed``
        and its DP rank); the batch contract in prompt order."""
        if len(prompts) % self.dp_size:
            raise ConfigError(
                [
                    (
                        "data.train_batch_size",
                        f"{len(prompts)} prompts to generate (prompts x rollout.n) cannot be split evenly over "
                        f"{self.dp_size} data-parallel ranks (trainer.world_size): make it a multiple",
                    )
                ]
            )
        shards = list(torch.arange(len(prompts)).chunk(self.dp_size))
        args = [
            ([prompts[i] for i in shard.tolist()], sampling, seed * 1_000_003 + dp)
            for dp, shard in enumerate(shards)
        ]
        results = self.group.call_each("generate", shards_for_ranks(args, self.topologies))
        return concat_batches(gather_outputs(results, self.topologies), sampling.pad_token_id)

    def compute_log_probs(self, batch: TensorDict) -> torch.Tensor:
        return self._per_row("compute_log_probs", batch)

    def compute_ref_log_probs(self, batch: TensorDict) -> torch.Tensor:
        return self._per_row("compute_ref_log_probs", batch)

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        return self._update(batch, num_mini_batches)

    def sync_weights(self) -> None:
        self.group.call("sync_weights")

    def weights(self) -> dict[str, torch.Tensor]:
        """The policy's full weights (Hugging Face names, on the CPU), gathered from the ranks."""
        return next(result for result in self.group.call("weights") if result is not None)

    def save_hf_model(self, path: str) -> None:
        self.group.call("save_hf_model", absolute_path(path))


class Critic(Role):
    """The value model over the critic's ranks."""

    def compute_values(self, batch: TensorDict) -> torch.Tensor:
        return self._per_row("compute_values", batch)

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        return self._update(batch, num_mini_batches)
