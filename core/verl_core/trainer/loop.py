"""The run loop the RL and SFT trainers share: resume, log, validate, checkpoint, export.

``Trainer.fit`` resumes from the newest complete checkpoint (saying which), validates once before
training (where the curves start), then runs ``train_step`` up to ``total_steps``, validating every
``trainer.test_freq`` steps and saving a checkpoint every ``trainer.save_freq`` steps (and at the last),
writes the Hugging Face export and ends with a summary on the console. Each step's metrics are logged
before its checkpoint is saved: a crash while saving repeats the step on resume (the logger replaces
its line), never leaves a resumed run without it. A trainer supplies the steps, the validation, the
checkpoints, a line about its data and the metrics its summary follows.
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Any

from verl_core.config.loading import fill_total_steps
from verl_core.config.run import RunConfig
from verl_core.data.sampler import EpochSampler
from verl_core.errors import NothingToTrain
from verl_core.toolkit.checkpoint import read_checkpoint_info
from verl_core.trainer import checkpoints, console
from verl_core.trainer.metrics import MetricsLogger
from verl_core.trainer.run_files import METRICS_FILE, read_records

#: Where the final Hugging Face export goes, inside the run folder.
HF_EXPORT_DIR = "hf_model"


class Trainer(abc.ABC):
    """Base of the trainers: ``config``, ``actor``, ``critic``, ``sampler``, ``val_data``, ``run_dir``,
    ``total_steps``, ``show_progress`` and ``global_step`` are set by the subclass."""

    #: ``trainer_state.json``'s ``trainer``: what tells one kind of run's checkpoint from another's.
    kind: str
    config: Any
    actor: Any
    critic: Any = None
    sampler: EpochSampler
    val_data: Any
    run_dir: Path
    total_steps: int
    show_progress: bool
    global_step: int
    #: The metrics the end-of-run summary follows from their first to their last value.
    summary_keys: tuple[str, ...] = ()
    #: The checkpoint the run resumed from (set by ``resume``), None for a fresh run.
    resumed_from: Path | None = None
    #: What ``fit`` is doing besides an update (``while saving the checkpoint of step 50 of 150``),
    #: None during one: where a stopped run says it stopped.
    stage: str | None = None

    @abc.abstractmethod
    def train_step(self, step: int) -> dict[str, float]:
        """Step ``step``'s update; its metrics."""

    @abc.abstractmethod
    def validate(self, step: int) -> dict[str, float]:
        """The validation metrics after ``step`` steps."""

    @abc.abstractmethod
    def data_summary(self) -> str:
        """One line about the training data (rows, what was filtered)."""

    def trainer_state(self) -> dict[str, Any]:
        """What of the trainer's own state a checkpoint keeps besides the step and the sampler (JSON-able)."""
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what ``trainer_state`` returned, from a checkpoint's ``trainer_state.json``."""
        del state  # nothing of its own by default

    def save_checkpoint(self, step: int) -> Path:
        """Publish step ``step``'s checkpoint: the roles' engines, the sampler and ``trainer_state``."""
        state = {"trainer": self.kind, "global_step": step, "sampler": self.sampler.state_dict()}
        return checkpoints.save(self.config, step, self.actor, self.critic, state | self.trainer_state())

    def resume(self) -> int:
        """Restore the newest complete checkpoint; the step to continue after (0 for a fresh run)."""
        restored = checkpoints.restore(self.config, self.kind, self.actor, self.critic)
        if restored is None:
            return 0
        self.resumed_from, state = restored
        self.sampler.load_state_dict(state["sampler"])
        self.load_trainer_state(state)
        return int(state["global_step"])

    def fit(self) -> dict[str, float]:
        """Train from the newest checkpoint (or the start) to ``total_steps``; the last step's metrics."""
        trainer = self.config.trainer
        started = time.perf_counter()
        self.global_step = self.resume()
        if self.resumed_from is not None:
            console.say(f"resumed from {self.resumed_from} at step {self.global_step} of {self.total_steps}")
        if self.global_step >= self.total_steps:
            console.say(nothing_to_train(self.resumed_from, self.global_step, self.total_steps))
            return {}
        console.say(self.data_summary())
        first_step = self.global_step
        metrics: dict[str, float] = {}
        with MetricsLogger(
            self.run_dir,
            trainer.logger,
            self.total_steps,
            show_progress=self.show_progress,
            start_step=self.global_step,
        ) as logger:
            if self.global_step == 0 and self.val_data is not None and trainer.test_freq:
                self.stage = "while validating before the first step"
                logger.log(0, self.validate(0))  # where the curves start
                self.stage = None
            while self.global_step < self.total_steps:
                step = self.global_step + 1
                metrics = self.train_step(step)
                self.global_step = step
                last = step == self.total_steps
                if (
                    trainer.test_freq
                    and self.val_data is not None
                    and (step % trainer.test_freq == 0 or last)
                ):
                    self.stage = f"while validating after step {step} of {self.total_steps}"
                    metrics |= self.validate(step)
                logger.log(step, metrics)
                if trainer.save_freq and (step % trainer.save_freq == 0 or last):
                    self.stage = f"while saving the checkpoint of step {step} of {self.total_steps}"
                    self.save_checkpoint(step)
                self.stage = None
        files = [f"metrics: {self.run_dir / METRICS_FILE}"]
        if trainer.save_hf_model:
            export = self.run_dir / HF_EXPORT_DIR
            self.stage = f"while writing the Hugging Face export to {export} (after step {self.global_step})"
            self.actor.save_hf_model(str(export))
            self.stage = None
            files.append(f"Hugging Face export: {export}")
        if trainer.save_freq:
            files.append(f"checkpoints: {trainer.checkpoint_dir}")
        records = read_records(self.run_dir / METRICS_FILE)
        console.summary(
            records, self.summary_keys, time.perf_counter() - started, self.global_step - first_step, files
        )
        return metrics


def epoch_sampler(config: RunConfig, num_rows: int) -> EpochSampler:
    """The order in which a run draws its ``num_rows`` training rows (``data`` section)."""
    data = config.data
    return EpochSampler(num_rows, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)


def run_length(config: RunConfig, num_rows: int) -> int:
    """Steps in the run: ``trainer.total_training_steps``, or ``trainer.total_epochs`` whole epochs of
    ``num_rows`` rows in batches of ``data.train_batch_size``."""
    epochs = epoch_sampler(config, num_rows).total_steps(config.trainer.total_epochs)
    return config.trainer.total_training_steps or epochs


def with_run_length(config: RunConfig, num_rows: int, updates_per_step: int = 1) -> tuple[RunConfig, int]:
    """``(config, steps)``: the run's length in steps (``run_length``), and ``config`` with a decaying
    learning rate's ``optim.total_steps: 0`` ("the run's length") set to its optimiser steps, that many
    steps of ``updates_per_step`` each (``verl_core.config.loading.fill_total_steps``)."""
    steps = run_length(config, num_rows)
    return fill_total_steps(config, steps, updates_per_step), steps


def check_not_finished(trainer: Any, total_steps: int) -> None:
    """Raise ``NothingToTrain`` when the checkpoint a run of ``total_steps`` would resume from is at its
    last step already (``trainer`` is the ``trainer`` config section): before any worker starts."""
    candidates = checkpoints.resume_candidates(trainer)
    if candidates:
        step = read_checkpoint_info(candidates[0]).global_step
        if step >= total_steps:
            raise NothingToTrain(nothing_to_train(candidates[0], step, total_steps))


def nothing_to_train(checkpoint: Path | None, step: int, total_steps: int) -> str:
    return (
        f"nothing to train: the checkpoint {checkpoint} is at step {step} of {total_steps}; raise "
        "trainer.total_training_steps (or trainer.total_epochs) to train on, or start a new run in another "
        "trainer.checkpoint_dir"
    )
