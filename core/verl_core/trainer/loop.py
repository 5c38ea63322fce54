"""The run loop the RL and SFT trainers share: resume, log, validate, checkpoint, export.

Before any worker starts, ``prepare_run`` holds the run's folders against a second run
(``run_lock``) and chooses the checkpoint to resume from, every piece of it checked. ``Trainer.fit``
resumes from it (saying which), validates once before training (where the curves start), then runs
``train_step`` up to ``total_steps``, validating every ``trainer.test_freq`` steps and saving a
checkpoint every ``trainer.save_freq`` steps (and at the last), writes the Hugging Face export and ends
with a summary on the console. Each step's metrics are logged before its checkpoint is saved: a crash
while saving repeats the step on resume (the logger replaces its line), never leaves a resumed run
without it. A run stopped after its last checkpoint but before its export was written makes the
export when started again. A trainer supplies the steps, the validation, the checkpoints, a line about
its data and the metrics its summary follows.
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Any

import attrs

from verl_core.config.convert import unstructure
from verl_core.config.loading import fill_total_steps
from verl_core.config.run import RunConfig
from verl_core.data.sampler import EpochSampler
from verl_core.errors import ConfigError, NothingToTrain, VerlCoreError
from verl_core.toolkit.checkpoint import read_checkpoint_info
from verl_core.trainer import checkpoints, console
from verl_core.trainer.metrics import MetricsLogger
from verl_core.trainer.run_files import (
    METRICS_FILE,
    exported_step,
    read_records,
    record_export,
    validation_samples_path,
)
from verl_core.trainer.run_lock import RunLock

#: Where the final Hugging Face export goes, inside the run folder.
HF_EXPORT_DIR = "hf_model"


@attrs.frozen
class PreparedRun:
    """What a run settles before its workers start (``prepare_run``): the hold on its folders, and the
    checkpoint it resumes from, None for a fresh run."""

    lock: RunLock
    checkpoint: Path | None

    def check_not_finished(self, trainer: Any, total_steps: int) -> None:
        """Raise ``NothingToTrain`` when ``checkpoint`` is at the last step of a run of ``total_steps``
        already and the run wrote everything after it (``missing_outputs``; ``trainer`` is the
        ``trainer`` config section): before any worker starts."""
        if self.checkpoint is None:
            return
        step = read_checkpoint_info(self.checkpoint).global_step
        if step >= total_steps and not missing_outputs(trainer, Path(trainer.run_dir), step):
            raise NothingToTrain(nothing_to_train(self.checkpoint, step, total_steps))


def prepare_run(config: RunConfig, kind: str) -> PreparedRun:
    """Hold the run's folders (``run_lock``: a folder another run holds is a ``FolderInUse`` naming it)
    and choose the checkpoint to resume from (``checkpoints.resume_point``: a damaged one skipped with a
    warning under ``auto``, an error naming the file otherwise), refusing one the engines cannot continue
    (``checkpoints.engine_problems``: another LoRA adapter, other base weights). Reads no weights beyond a
    sample for the fingerprint, starts no worker."""
    trainer = config.trainer
    problems = list(checkpoints.checkpoint_dir_problems(trainer, kind))
    if problems:
        raise ConfigError(problems)
    folders = {}
    if trainer.save_freq or Path(trainer.checkpoint_dir).is_dir():
        folders["trainer.checkpoint_dir"] = trainer.checkpoint_dir
    folders["trainer.run_dir"] = trainer.run_dir
    lock = RunLock(folders)
    lock.acquire()
    try:
        resume_from = checkpoints.resume_point(trainer)
        problems = checkpoints.engine_problems(config, resume_from) if resume_from is not None else []
        if problems:
            raise ConfigError(problems)
        return PreparedRun(lock, resume_from)
    except BaseException:
        lock.release()
        raise


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
    #: The run's folders held and its checkpoint chosen (``from_config`` sets it before the workers
    #: start; ``fit`` prepares the run itself otherwise), until ``fit`` ends or ``shutdown``.
    prepared: PreparedRun | None = None

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

    def sampler_state(self) -> dict[str, Any]:
        """The sampler's state as of the step just trained, for its checkpoint."""
        return self.sampler.state_dict()

    def save_checkpoint(self, step: int) -> Path:
        """Publish step ``step``'s checkpoint: the roles' engines, the sampler and ``trainer_state``."""
        state = {"trainer": self.kind, "global_step": step, "sampler": self.sampler_state()}
        return checkpoints.save(self.config, step, self.actor, self.critic, state | self.trainer_state())

    def resume(self) -> int:
        """Restore the checkpoint the run resumes from (``prepare_run``'s choice, the newest complete
        one under ``auto``); the step to continue after (0 for a fresh run)."""
        if self.prepared is not None:
            checkpoint = self.prepared.checkpoint
        else:
            checkpoint = checkpoints.resume_point(self.config.trainer)
        restored = checkpoints.restore(self.config, self.kind, self.actor, self.critic, checkpoint)
        if restored is None:
            return 0
        self.resumed_from, state = restored
        self.sampler.load_state_dict(state["sampler"])
        self.load_trainer_state(state)
        return int(state["global_step"])

    def release(self) -> None:
        """Let the run's folders go (``run_lock``), for another run to use."""
        if self.prepared is not None:
            self.prepared.lock.release()
            self.prepared = None

    def fit(self) -> dict[str, float]:
        """Train from the newest checkpoint (or the start) to ``total_steps``; the last step's metrics.
        The run's folders are held until it returns (``prepare_run``)."""
        if self.prepared is None:
            self.prepared = prepare_run(self.config, self.kind)
        try:
            return self._fit()
        finally:
            self.release()

    def _fit(self) -> dict[str, float]:
        trainer = self.config.trainer
        started = time.perf_counter()
        self.global_step = self.resume()
        if self.resumed_from is not None:
            console.say(f"resumed from {self.resumed_from} at step {self.global_step} of {self.total_steps}")
        first_step = self.global_step
        metrics: dict[str, float] = {}
        if self.global_step < self.total_steps:
            console.say(self.data_summary())
            metrics = self._train()
        else:
            missing = missing_outputs(trainer, self.run_dir, self.global_step)
            if not missing:
                console.say(nothing_to_train(self.resumed_from, self.global_step, self.total_steps))
                return {}
            console.say(
                f"the checkpoint {self.resumed_from} is at the run's last step, but the run stopped before its "
                f"{' and '.join(missing)} was written: writing it now"
            )
        files = [f"metrics: {self.run_dir / METRICS_FILE}"]
        if trainer.save_hf_model:
            export = self.run_dir / HF_EXPORT_DIR
            self.stage = f"while writing the Hugging Face export to {export} (after step {self.global_step})"
            self.actor.save_hf_model(str(export))
            record_export(export, self.global_step)  # once it is whole: a stop before leaves none
            self.stage = None
            files.append(f"Hugging Face export: {export}")
        if trainer.save_freq:
            files.append(f"checkpoints: {trainer.checkpoint_dir}")
        records = read_records(self.run_dir / METRICS_FILE)
        console.summary(
            records, self.summary_keys, time.perf_counter() - started, self.global_step - first_step, files
        )
        return metrics

    def _train(self) -> dict[str, float]:
        """The steps after ``global_step`` up to ``total_steps``, validated, logged and checkpointed; the
        last step's metrics."""
        trainer = self.config.trainer
        metrics: dict[str, float] = {}
        with MetricsLogger(
            self.run_dir,
            trainer.logger,
            self.total_steps,
            show_progress=self.show_progress,
            start_step=self.global_step,
            config=unstructure(self.config),
            project=trainer.project_name,
            experiment_name=trainer.experiment_name,
            tracking_uri=trainer.tracking_uri,
        ) as logger:
            if self.global_step == 0 and self.val_data is not None and trainer.test_freq:
                self.stage = "while validating before the first step"
                logger.log(0, self._validate_and_log_samples(logger, 0))  # where the curves start
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
                    metrics |= self._validate_and_log_samples(logger, step)
                logger.log(step, metrics)
                if trainer.save_freq and (step % trainer.save_freq == 0 or last):
                    self.stage = f"while saving the checkpoint of step {step} of {self.total_steps}"
                    self.save_checkpoint(step)
                self.stage = None
            if logger.has_trackers:
                self._curves_to_trackers(logger)
        return metrics

    def _curves_to_trackers(self, logger: MetricsLogger) -> None:
        """Draw the curves (``RUN_DIR/curves.png``) and hand the picture to the trackers; a picture that
        cannot be drawn is a warning."""
        from verl_core.trainer.plot import plot_run

        try:
            logger.log_artifact(plot_run(self.run_dir))
        except VerlCoreError as error:
            console.warn(f"no curves for the metric sinks: {error}")

    def _validate_and_log_samples(self, logger: MetricsLogger, step: int) -> dict[str, float]:
        """``validate(step)``; the samples it wrote (``validation/step_N.jsonl``) go to the sinks."""
        started = time.time()
        metrics = self.validate(step)
        samples = validation_samples_path(self.run_dir, step)
        if samples.is_file() and samples.stat().st_mtime >= started - 1:  # written now, not by an older run
            logger.log_samples(step, read_records(samples))
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


def missing_outputs(trainer: Any, run_dir: Path, step: int) -> list[str]:
    """What a run that trained to ``step`` writes after its last checkpoint and that is not there: its
    Hugging Face export (``trainer.save_hf_model``), when ``run_dir`` holds none of that step."""
    if trainer.save_hf_model and exported_step(run_dir / HF_EXPORT_DIR) != step:
        return ["Hugging Face export"]
    return []


def nothing_to_train(checkpoint: Path | None, step: int, total_steps: int) -> str:
    return (
        f"nothing to train: the checkpoint {checkpoint} is at step {step} of {total_steps}; raise "
        "trainer.total_training_steps (or trainer.total_epochs) to train on, or start a new run in another "
        "trainer.checkpoint_dir"
    )
