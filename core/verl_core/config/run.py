"""The run config: one attrs class per section of a training run's YAML file.

To extend a section, add a field with a default (and a validator from ``verl_core.config.validators``
where a range applies); to add a section, add a class here and a field to ``RunConfig``. Loading,
overrides, error reporting and unstructuring need no other change; list the key in docs/config.md
(a test checks the tables). Rules that relate fields go in a ``check()`` method yielding
``(relative.path, message)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import attrs

from verl_core.config.algorithm import AlgorithmConfig, CriticLossConfig, PolicyLossConfig
from verl_core.config.engine import EngineConfig
from verl_core.config.validators import in_range, non_empty, non_negative, positive

#: Advantage estimators that compare the responses to one prompt: one response per prompt
#: leaves nothing to compare (zero advantages, or a division by zero).
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "grpo_passk")


@attrs.define
class ActorConfig:
    """The ``actor`` section: the policy's engine, its loss, and how a batch becomes PPO updates."""

    engine: EngineConfig
    policy_loss: PolicyLossConfig = attrs.field(factory=PolicyLossConfig)
    #: Prompts per optimiser step (each with its ``rollout.n`` responses); divides ``data.train_batch_size``.
    ppo_mini_batch_size: int = attrs.field(default=8, validator=positive)
    #: Passes over each generated batch.
    ppo_epochs: int = attrs.field(default=1, validator=positive)


@attrs.define
class RefConfig:
    """The ``ref`` section: the frozen reference policy of the KL terms.

    ``engine: null`` (the default) gives the reference the actor's engine config; see
    ``RunConfig.ref_engine``. It is used only when a KL term is on.
    """

    engine: EngineConfig | None = None


@attrs.define
class CriticConfig:
    """The ``critic`` section: the value model trained next to the actor (needed by ``gae``)."""

    enable: bool = False
    engine: EngineConfig | None = None
    loss: CriticLossConfig = attrs.field(factory=CriticLossConfig)

    def check(self) -> Iterator[tuple[str, str]]:
        if self.enable and self.engine is None:
            yield "engine", "required when critic.enable is true: give it backend and model like actor.engine"


@attrs.define
class RolloutConfig:
    """The ``rollout`` section: how responses are generated."""

    #: Name of a registered rollout backend (``verl-core plugins`` lists them).
    backend: str = "hf"
    #: Responses per prompt.
    n: int = attrs.field(default=1, validator=positive)
    temperature: float = attrs.field(default=1.0, validator=positive)
    top_p: float = attrs.field(default=1.0, validator=in_range(0, 1, include_low=False))
    #: Sample among the ``top_k`` most likely tokens; 0 disables.
    top_k: int = attrs.field(default=0, validator=non_negative)
    #: Longest prompt, in tokens (longer ones are filtered out); generated tokens per response at most.
    prompt_length: int = attrs.field(default=512, validator=positive)
    response_length: int = attrs.field(default=512, validator=positive)


@attrs.define
class DataConfig:
    """The ``data`` section: the prompt datasets and how they are batched."""

    train_files: list[str] = attrs.field(factory=list)
    val_files: list[str] = attrs.field(factory=list)
    #: Prompts per training step.
    train_batch_size: int = attrs.field(default=8, validator=positive)
    #: Column holding the prompt.
    prompt_key: str = attrs.field(default="prompt", validator=non_empty)
    shuffle: bool = True
    #: Seed of the shuffling order.
    seed: int = 0


@attrs.define
class TrainerConfig:
    """The ``trainer`` section: run length, evaluation, checkpoints, logging."""

    total_epochs: int = attrs.field(default=1, validator=positive)
    #: Stop after this many steps; ``None`` runs ``total_epochs`` full epochs.
    total_training_steps: int | None = attrs.field(default=None, validator=positive)
    #: Save a checkpoint / validate every this many steps; 0 disables.
    save_freq: int = attrs.field(default=0, validator=non_negative)
    test_freq: int = attrs.field(default=0, validator=non_negative)
    checkpoint_dir: str = attrs.field(default="checkpoints", validator=non_empty)
    #: ``auto``: resume from the latest checkpoint in ``checkpoint_dir`` if any; ``disable``: start
    #: fresh; ``resume_path``: resume from ``resume_from_path``.
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    seed: int = 0
    #: Metric sinks, by name.
    logger: list[str] = attrs.field(factory=lambda: ["console"])

    def check(self) -> Iterator[tuple[str, str]]:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            yield (
                "resume_from_path",
                "required when resume_mode is 'resume_path': set the checkpoint to resume",
            )


@attrs.define
class RunConfig:
    """A whole training run; ``verl_core.config.load_config`` builds it from YAML and overrides."""

    actor: ActorConfig
    ref: RefConfig = attrs.field(factory=RefConfig)
    critic: CriticConfig = attrs.field(factory=CriticConfig)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)

    @property
    def ref_engine(self) -> EngineConfig:
        """The reference policy's engine config: ``ref.engine``, or else the actor's."""
        return self.ref.engine if self.ref.engine is not None else self.actor.engine

    def check(self) -> Iterator[tuple[str, str]]:
        batch, mini_batch = self.data.train_batch_size, self.actor.ppo_mini_batch_size
        if batch % mini_batch:
            yield (
                "actor.ppo_mini_batch_size",
                f"must divide data.train_batch_size ({batch}) into whole mini-batches, got {mini_batch}",
            )
        estimator = self.algorithm.adv_estimator
        if estimator in GROUP_ESTIMATORS and self.rollout.n < 2:
            yield (
                "rollout.n",
                f"adv_estimator '{estimator}' compares the responses to each prompt: set rollout.n >= 2",
            )
        if estimator == "gae" and not self.critic.enable:
            yield (
                "critic.enable",
                "adv_estimator 'gae' needs a critic's values: set critic.enable=true and a critic.engine, "
                "or choose an estimator without a critic (algorithm.adv_estimator=grpo)",
            )
