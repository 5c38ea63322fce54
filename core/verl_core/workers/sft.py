"""Supervised fine-tuning on the same engines and worker groups as RL: the rank side and the trainer's view.

``SFTWorker`` is one rank of the ``sft`` role: it holds only the policy engine of ``actor.engine``
(role ``lm``), no rollout and no reference. Its loss is the negative log-likelihood of the response
tokens (``response_mask``), teacher-forced at temperature 1, as a token mean over the whole step:
each micro-batch returns its summed NLL divided by the step's global token count times the DP size
(the engine's loss contract, docs/engine.md), so that the loss and the gradient do not depend on how
the step is split into micro-batches and ranks. ``SFT`` is the trainer's typed front end over a
worker group of them, dispatching by the engine's topology like ``Actor`` and ``Critic``.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from verl_core.algos.aggregation import TOKEN_MEAN, agg_loss
from verl_core.config.paths import absolute_path
from verl_core.config.run import RunConfig
from verl_core.data.batch import RESPONSE_MASK, get_global_counts
from verl_core.engine import COMPUTE_ENTROPY, LOG_PROBS, TEMPERATURE, build_engine
from verl_core.engine.topology import Topology
from verl_core.workers.dispatch import gather_outputs, shards_for_ranks, split_batch
from verl_core.workers.roles import Role
from verl_core.workers.workers import engine_topology, mean_metrics, mini_batches, skipped_steps


def nll_loss(
    output: dict[str, torch.Tensor], micro_batch: TensorDict, dp_group: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """The SFT loss contract: this micro-batch's share of the step's token-mean NLL of the responses."""
    loss = agg_loss(
        -output[LOG_PROBS], micro_batch[RESPONSE_MASK], TOKEN_MEAN, get_global_counts(micro_batch)
    )
    return loss, {}


def _teacher_forced(batch: TensorDict) -> TensorDict:
    """``batch`` (a shallow copy) set for the log-likelihood of its own tokens: temperature 1, no entropy."""
    batch = batch.copy()
    batch.set_non_tensor(TEMPERATURE, 1.0)
    batch.set_non_tensor(COMPUTE_ENTROPY, False)
    return batch


class SFTWorker:
    """One rank of the SFT role. ``registry`` resolves backends (default: the installed plugins)."""

    def __init__(self, config: RunConfig, registry: Any = None):
        from verl_core.plugins import get_registry

        self.config = config
        self.policy = build_engine(
            config.actor.engine, "lm", registry or get_registry(), config_path="actor.engine"
        )

    def initialize(self) -> Topology:
        self.policy.initialize()
        return engine_topology(self.policy)

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        """``num_mini_batches`` optimiser steps over this rank's share: ``sft/loss``, ``sft/grad_norm``,
        ``sft/lr`` (means over the steps) and ``sft/skipped_steps`` (non-finite gradient norms)."""
        batch = _teacher_forced(batch)
        with self.policy.train_mode():
            steps = [
                self.policy.train_batch(mini_batch, nll_loss)
                for mini_batch in mini_batches(batch, num_mini_batches)
            ]
        metrics = mean_metrics(steps, "sft")
        metrics["sft/skipped_steps"] = skipped_steps(steps)
        return metrics

    def compute_loss(self, batch: TensorDict) -> dict[str, float]:
        """Forward only: ``loss``, the token-mean NLL of the responses of the whole batch (all ranks)."""
        with self.policy.eval_mode():
            result = self.policy.infer_batch(_teacher_forced(batch), nll_loss)
        return {"loss": result.loss}

    # -- checkpoints and export --------------------------------------------------------------------

    def save_checkpoint(self, path: str, global_step: int) -> None:
        self.policy.save_checkpoint(path, global_step)

    def load_checkpoint(self, path: str) -> int:
        return self.policy.load_checkpoint(path)

    def save_hf_model(self, path: str) -> None:
        self.policy.save_hf_model(path)


class SFT(Role):
    """The policy being fine-tuned, over the SFT role's ranks."""

    def update(self, batch: TensorDict, num_mini_batches: int) -> dict[str, float]:
        return self._update(batch, num_mini_batches)

    def compute_loss(self, batch: TensorDict) -> dict[str, float]:
        """The batch's token-mean NLL, forward only; ``batch`` divides over the DP size like an update's."""
        shards = split_batch(batch, self.dp_size)
        results = self.group.call_each(
            "compute_loss", shards_for_ranks([(batch[s],) for s in shards], self.topologies)
        )
        return gather_outputs(results, self.topologies)[0]  # a global loss: every output rank has it

    def save_hf_model(self, path: str) -> None:
        self.group.call("save_hf_model", absolute_path(path))
