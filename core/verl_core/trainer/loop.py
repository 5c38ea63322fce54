"""The run loop the RL and SFT trainers share: resume, log, validate, checkpoint, export.

``Trainer.fit`` resumes from the newest complete checkpoint, validates once before training (where the
curves start), then runs ``train_step`` up to ``total_steps``, validating every ``trainer.test_freq``
steps and saving a checkpoint every ``trainer.save_freq`` steps (and at the last), and finally writes
the Hugging Face export. Each step's metrics are logged before its checkpoint is saved: a crash while
saving repeats the step on resume (the logger replaces its line), never leaves a resumed run without
it. A trainer supplies the steps, the validation, the checkpoints and a line about its data.
"""

from __future__ import annotations

import abc
import sys
from pathlib import Path
from typing import Any

from verl_core.trainer.metrics import MetricsLogger

#: Where the final Hugging Face export goes, inside the run folder.
HF_EXPORT_DIR = "hf_model"


class Trainer(abc.ABC):
    """Base of the trainers: ``config``, ``actor``, ``val_data``, ``run_dir``, ``total_steps``,
    ``show_progress`` and ``global_step`` are set by the subclass."""

    config: Any
    actor: Any
    val_data: Any
    run_dir: Path
    total_steps: int
    show_progress: bool
    global_step: int

    @abc.abstractmethod
    def resume(self) -> int:
        """Restore the newest checkpoint; the step to continue after (0 for a fresh run)."""

    @abc.abstractmethod
    def train_step(self, step: int) -> dict[str, float]:
        """Step ``step``'s update; its metrics."""

    @abc.abstractmethod
    def validate(self, step: int) -> dict[str, float]:
        """The validation metrics after ``step`` steps."""

    @abc.abstractmethod
    def save_checkpoint(self, step: int) -> Path:
        """Publish step ``step``'s checkpoint."""

    @abc.abstractmethod
    def data_summary(self) -> str:
        """One line about the training data (rows, what was filtered)."""

    def fit(self) -> dict[str, float]:
        """Train from the newest checkpoint (or the start) to ``total_steps``; the last step's metrics."""
        trainer = self.config.trainer
        self.global_step = self.resume()
        print(f"verl-core: {self.data_summary()}", file=sys.stderr)
        metrics: dict[str, float] = {}
        with MetricsLogger(
            self.run_dir,
            trainer.logger,
            self.total_steps,
            show_progress=self.show_progress,
            start_step=self.global_step,
        ) as logger:
            if self.global_step == 0 and self.val_data is not None and trainer.test_freq:
                logger.log(0, self.validate(0))  # where the curves start
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
                    metrics |= self.validate(step)
                logger.log(step, metrics)
                if trainer.save_freq and (step % trainer.save_freq == 0 or last):
                    self.save_checkpoint(step)
        if trainer.save_hf_model:
            self.actor.save_hf_model(str(self.run_dir / HF_EXPORT_DIR))
        return metrics
