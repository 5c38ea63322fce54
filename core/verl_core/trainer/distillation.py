"""On-policy distillation in the RL loop: each response scored by its teacher, and the signal added
to the step (docs/distillation.md).

The student samples as in RL. Each response is routed to one teacher (``distillation.route_by``: a data
column naming it; with one teacher, that one), which scores it at the rollout's temperature: its
log-probs of the sampled tokens, and with ``top_k`` its ``k`` likeliest tokens at each position. Then
``loss: reverse_kl`` gives each sampled token ``coef * (log pi_teacher - log pi_student)``: added to its
advantage once the estimator has run on the task reward (``reverse_kl_as: advantage``), or to its
reward before (``reward``); ``loss: gkd`` hands the teacher's top-k to the actor's update
(``CANDIDATE_IDS``: the student's log-probs at those ids, against the teacher's). The task reward's
advantages (its rewards, with ``reverse_kl_as: reward``) are weighted by ``task_reward_coef``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from tensordict import TensorDict

from verl_core.algos.aggregation import masked_mean
from verl_core.algos.distillation import reverse_kl_rewards
from verl_core.config.run import RunConfig
from verl_core.data.batch import (
    ADVANTAGES,
    CANDIDATE_IDS,
    OLD_LOG_PROBS,
    RESPONSE_MASK,
    TEACHER_LOG_PROBS,
    TEACHER_TOP_K_IDS,
    TOKEN_LEVEL_REWARDS,
    select_rows,
)
from verl_core.data.dataset import PromptRow
from verl_core.errors import TrainerError
from verl_core.workers.roles import Actor, Teacher

#: ``[B]`` int64: the teacher that scores each response, as its position in ``distillation.teachers``.
TEACHER_INDEX = "teacher_index"


class Teachers:
    """The run's teachers: colocated ones through the ``actor``'s ranks, the others through their own
    role (``separate``, by name)."""

    def __init__(self, config: RunConfig, actor: Actor, separate: Mapping[str, Teacher]):
        self.config = config.distillation
        self.names = list(self.config.teachers)
        self._scorers: dict[str, Callable[[TensorDict], TensorDict]] = {
            name: separate[name].compute_outputs
            if name in separate
            else (lambda batch, name=name: actor.compute_teacher_outputs(batch, name))
            for name in self.names
        }

    def route(self, rows: Sequence[PromptRow], n: int) -> torch.Tensor:
        """``[len(rows) * n]``: the teacher of each of the ``n`` responses to each prompt row."""
        column = self.config.route_by
        if column is None:
            return torch.zeros(len(rows) * n, dtype=torch.int64)
        indices = []
        for row in rows:
            name = row.extra.get(column)
            if name not in self.config.teachers:  # preflight read the files; the data changed since
                raise TrainerError(
                    f"distillation.route_by: the prompt {row.prompt_text[:60]!r} routes to {name!r}, which is "
                    f"not a teacher (distillation.teachers: {', '.join(self.names)}); fix the row"
                )
            indices.append(self.names.index(name))
        return torch.tensor(indices, dtype=torch.int64).repeat_interleave(n)

    def score(self, batch: TensorDict) -> TensorDict:
        """Every response's scores from its teacher (``TEACHER_LOG_PROBS``, and the top-k with ``top_k``)."""
        if len(self.names) == 1:
            return self._scorers[self.names[0]](batch)
        routes = batch[TEACHER_INDEX]
        parts = {
            index: (rows, self._scorers[name](select_rows(batch, rows)))
            for index, name in enumerate(self.names)
            if (rows := (routes == index).nonzero().squeeze(-1)).numel()
        }
        _, first = next(iter(parts.values()))
        scores = TensorDict(
            {key: value.new_zeros((routes.shape[0], *value.shape[1:])) for key, value in first.items()},
            batch_size=routes.shape,
        )
        for rows, part in parts.values():
            scores[rows] = part
        return scores

    def distill(self, batch: TensorDict) -> dict[str, float]:
        """Before the advantages: score ``batch`` (in place: the teachers' outputs join it) and, with
        ``reverse_kl_as: reward``, put the signal into the token-level rewards. The metrics:
        ``distillation/reverse_kl`` (the token mean of ``log pi_student - log pi_teacher`` on the sampled
        tokens, per teacher too with several)."""
        batch.update(self.score(batch))
        mask = batch[RESPONSE_MASK]
        log_ratio = batch[OLD_LOG_PROBS] - batch[TEACHER_LOG_PROBS]
        metrics = {"distillation/reverse_kl": float(masked_mean(log_ratio, mask))}
        if len(self.names) > 1:
            for index, name in enumerate(self.names):
                routed = mask * (batch[TEACHER_INDEX] == index).unsqueeze(-1)
                if routed.any():
                    metrics[f"distillation/{name}/reverse_kl"] = float(masked_mean(log_ratio, routed))
        if self._into_rewards:
            batch[TOKEN_LEVEL_REWARDS] = self.config.task_reward_coef * batch[
                TOKEN_LEVEL_REWARDS
            ] + self._signal(batch)
        return metrics

    def add_to_advantages(self, batch: TensorDict) -> None:
        """After the estimator: the task's advantages weighted by ``task_reward_coef``, plus each token's
        reverse-KL signal (``reverse_kl_as: advantage``); GKD's candidates for the update. Nothing with
        ``reverse_kl_as: reward`` (the estimator took the signal)."""
        if self._into_rewards:
            return
        advantages = self.config.task_reward_coef * batch[ADVANTAGES]
        if self.config.loss == "reverse_kl":
            advantages = advantages + self._signal(batch)
        else:
            batch[CANDIDATE_IDS] = batch[TEACHER_TOP_K_IDS]
        batch[ADVANTAGES] = advantages

    @property
    def _into_rewards(self) -> bool:
        return self.config.loss == "reverse_kl" and self.config.reverse_kl_as == "reward"

    def _signal(self, batch: TensorDict) -> torch.Tensor:
        """``coef * (log pi_teacher - log pi_student)`` of each sampled token (0 off the response mask)."""
        return self.config.coef * reverse_kl_rewards(
            batch[OLD_LOG_PROBS], batch[TEACHER_LOG_PROBS], batch[RESPONSE_MASK]
        )
