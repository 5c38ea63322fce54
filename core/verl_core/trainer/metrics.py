"""The sinks that show and keep every step's metrics, and the metric keys they agree on.

The trainer hands each step's metrics (its own, ``verl_core.trainer.timing``'s phases and throughput)
to ``MetricsLogger.log``, which

- appends one JSON object to ``RUN_DIR/metrics.jsonl``, always: ``verl-core plot`` redraws the curves
  from it, and a resumed run continues it;
- hands them to the metric sinks ``trainer.logger`` names (``verl_core.trainer.sinks``: ``console``
  prints one line, ``tensorboard`` writes scalars under ``RUN_DIR/tensorboard/``, the trackers
  ``wandb``, ``mlflow`` and ``trackio`` record them in threads of their own), with the validation
  samples (``log_samples``) and, at the end of the run, the curves' picture (``finish``);
- moves a progress bar (step/total, reward, tokens/s, ETA) on stderr when that is a terminal, and
  otherwise, when no console line is printed either, writes a plain progress line every tenth of the
  run (and at least every ``PROGRESS_EVERY_S`` seconds), so that a run under a pipe is never silent.

The trainer, the console line, the progress bar and the plot agree on the metric keys through the
``*_KEY`` constants here and in ``timing``; docs/training.md ("Metrics, logs and plots") lists every key and the run folder's layout.
Importing this module imports neither torch nor tqdm: each sink loads what it needs when it is made.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from verl_core.errors import ConfigError, VerlCoreError
from verl_core.hookspecs import Kind
from verl_core.trainer import console
from verl_core.trainer.run_files import METRICS_FILE, read_records, write_jsonl
from verl_core.trainer.sinks import BaseMetricSink, SinkChannel, SinkRun

if TYPE_CHECKING:
    from verl_core.plugins import Registry
from verl_core.trainer.timing import STEP_TIME_KEY, TOKENS_PER_S_KEY

#: The mean score of the step's responses as the reward function gave them (before any KL penalty).
REWARD_KEY = "reward/mean"
#: The mean validation score over every validation prompt (``validation.summarize``).
VAL_SCORE_KEY = "val/score/mean"
#: The actor's policy loss and the critic's value loss, averaged over the step's updates.
ACTOR_LOSS_KEY = "actor/loss"
CRITIC_LOSS_KEY = "critic/loss"
#: Keys the console line shows first, in this order, where the step has them; the others follow sorted.
CONSOLE_FIRST: tuple[str, ...] = (
    REWARD_KEY,
    VAL_SCORE_KEY,
    ACTOR_LOSS_KEY,
    CRITIC_LOSS_KEY,
    "sft/loss",
    "val/loss",
    "actor/grad_norm",
    "actor/lr",
    "response_length/mean",
    TOKENS_PER_S_KEY,
    STEP_TIME_KEY,
)
#: Without a terminal and without console lines, a progress line at least this often (seconds).
PROGRESS_EVERY_S = 30.0


# -- the metric sinks -----------------------------------------------------------------------------


def check_loggers(loggers: str | Iterable[str], registry: Registry | None = None) -> tuple[str, ...]:
    """``trainer.logger`` as a tuple of sink names the registry provides (default: the installed
    plugins'), or a ``ConfigError`` at ``trainer.logger`` for each it refuses: an unknown name (with the
    close match and the installed sinks), a sink whose package is not installed (with the pip command)."""
    from verl_core.plugins.registry import registry_or_installed

    names = (loggers,) if isinstance(loggers, str) else tuple(loggers)
    registry = registry_or_installed(registry)
    problems = []
    for name in names:
        try:
            registry.entry(Kind.METRIC_SINKS, name, where="trainer.logger")
        except VerlCoreError as error:
            note = f"{METRICS_FILE} in the run folder is written in any case"
            problems.append(("trainer.logger", " ".join(str(error).splitlines()) + f" ({note})"))
    if problems:
        raise ConfigError(problems)
    return names


class MetricsLogger:
    """Every step's metrics to ``run_dir/metrics.jsonl`` and the sinks ``loggers`` names.

    ``loggers`` is ``trainer.logger``: names of metric sinks (``check_loggers``), looked up in
    ``registry`` (default: the installed plugins'); ``total_steps`` the run's length, for the console
    line and the progress bar. ``start_step`` is the step the run resumes after (the checkpoint's
    step), 0 for a fresh run: lines of later steps already in ``metrics.jsonl`` are dropped, so that
    the steps the resumed run repeats are not there twice, and a fresh run starts the file over; each
    sink continues its own record likewise (``verl_core.trainer.sinks``). ``config`` (the resolved
    run config as plain data), ``project``, ``experiment_name`` (default: the run folder's name) and
    ``tracking_uri`` are what the trackers record the run under (``SinkRun``).

    The progress bar is shown on stderr when ``show_progress`` is true and stderr is a terminal, and
    always with ``force_progress``. Call ``finish()`` when the run has trained its last step, and
    ``close()`` at the end, or use the logger as a context manager.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        loggers: str | Iterable[str],
        total_steps: int,
        show_progress: bool = True,
        *,
        start_step: int = 0,
        force_progress: bool = False,
        config: Mapping[str, Any] | None = None,
        project: str = "verl-core",
        experiment_name: str | None = None,
        tracking_uri: str | None = None,
        registry: Registry | None = None,
    ) -> None:
        from verl_core.plugins.registry import registry_or_installed

        registry = registry_or_installed(registry)
        self.loggers = check_loggers(loggers, registry)
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self._channels: list[SinkChannel] = []
        self._file: TextIO | None = None
        self._bar: Any = None
        run = SinkRun(
            run_dir=self.run_dir,
            project=project,
            name=experiment_name or self.run_dir.resolve().name,
            tracking_uri=tracking_uri,
            config=dict(config or {}),
            start_step=start_step,
            total_steps=total_steps,
        )
        entries = [registry.entry(Kind.METRIC_SINKS, name, where="trainer.logger") for name in self.loggers]
        try:
            # The sinks made in this thread first (TensorBoard): one that cannot start fails before any
            # file is touched. The trackers start in their threads once metrics.jsonl is settled.
            for entry in entries:
                if not entry.descriptor.background:
                    self._channels.append(SinkChannel(entry.name, entry.load("sink"), run, background=False))
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.truncate_after(start_step if start_step > 0 else -1)
            for entry in entries:
                if entry.descriptor.background:
                    self._channels.append(SinkChannel(entry.name, entry.load("sink"), run, background=True))
        except BaseException:
            self.close()
            raise
        if force_progress or (show_progress and sys.stderr.isatty()):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, unit="step", file=sys.stderr, dynamic_ncols=True
            )
            console.set_progress_bar(self._bar)  # the run's other lines (samples, warnings) go above it
        #: A plain progress line every this many steps, when neither the bar nor console lines show.
        self._progress_every = (
            max(1, total_steps // 10)
            if show_progress and self._bar is None and "console" not in self.loggers
            else 0
        )
        self._started, self._start_step = time.perf_counter(), start_step
        self._last_progress = self._started

    def truncate_after(self, step: int) -> None:
        """Keep the lines of ``metrics.jsonl`` of steps up to ``step``, drop those of later steps.

        A last line cut short (a crash while writing it) is dropped too; any other line that is not a
        JSON object with an integer ``step`` is an error naming the file and the line. The file is
        replaced atomically, and this logger appends to it afterwards.
        """
        if self._file is not None:
            self._file.close()
        kept = [record for record in read_records(self.path) if record["step"] <= step]
        write_jsonl(self.path, kept)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of ``step``: one line in ``metrics.jsonl`` (flushed), then the sinks (the
        console line, TensorBoard scalars, the trackers), the progress bar.

        Values are numbers (0-d tensors and NumPy scalars count). NaN and infinities are written to
        the JSONL file as ``null``, with a note on stderr naming them.
        """
        if self._file is None:
            raise VerlCoreError(
                f"{self.path}: this MetricsLogger is closed; make a new one to log step {step}"
            )
        values = {key: _number(step, key, value) for key, value in metrics.items()}
        if "step" in values:
            raise ValueError(
                f"step {step}: 'step' is the line's own key in {METRICS_FILE}; rename the metric"
            )
        not_finite = [key for key, value in values.items() if not math.isfinite(value)]
        record = {"step": step} | {key: None if key in not_finite else value for key, value in values.items()}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if not_finite:
            listed = ", ".join(f"{key}={values[key]}" for key in not_finite)
            console.write(f"note: step {step}: {listed}: written as null in {self.path}", sys.stderr)
        for channel in self._channels:
            channel.send("log_metrics", step, values)
        if self._progress_every:
            self._plain_progress(step, values)
        if self._bar is not None:
            shown = {"reward": values.get(REWARD_KEY), "tok/s": values.get(TOKENS_PER_S_KEY)}
            self._bar.set_postfix_str(
                " ".join(f"{name}={_format(value)}" for name, value in shown.items() if value is not None),
                refresh=False,
            )
            self._bar.update(step - self._bar.n)

    def _plain_progress(self, step: int, values: Mapping[str, float]) -> None:
        now = time.perf_counter()
        due = step % self._progress_every == 0 or step == self.total_steps
        if not (due or now - self._last_progress >= PROGRESS_EVERY_S) or step <= self._start_step:
            return
        self._last_progress = now
        per_step = (now - self._started) / (step - self._start_step)
        shown = [f"{key}={_format(values[key])}" for key in (REWARD_KEY, VAL_SCORE_KEY) if key in values]
        print(
            f"verl-core: step {step}/{self.total_steps} ({100 * step // self.total_steps}%), "
            f"{per_step:.2f} s/step, about {per_step * (self.total_steps - step):.0f} s left"
            + "".join(f", {item}" for item in shown),
            file=sys.stderr,
            flush=True,
        )

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Hand the validation samples of ``step`` (the rows of ``validation/step_N.jsonl``) to the sinks."""
        for channel in self._channels:
            channel.send("log_samples", step, [dict(row) for row in rows])

    @property
    def has_trackers(self) -> bool:
        """Whether a sink runs in the background (a tracker): one that keeps the curves' picture."""
        return any(channel.background for channel in self._channels)

    def log_artifact(self, path: Path) -> None:
        """Hand the file ``path`` (the curves' picture, at the end of the run) to the sinks."""
        for channel in self._channels:
            channel.send("log_artifact", None, path)

    def close(self) -> None:
        """Close the sinks (the trackers send what they hold first), the JSONL file and the progress
        bar; closing twice is fine."""
        if self._bar is not None:
            console.set_progress_bar(None)
            self._bar.close()
            self._bar = None
        channels, self._channels = self._channels, []
        for channel in channels:
            channel.close()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _number(step: int, key: str, value: Any) -> float:
    """A metric's value as a Python ``int`` or ``float``, or a ``TypeError`` naming the metric."""
    if not isinstance(key, str):
        raise TypeError(f"step {step}: metric names are strings, got {key!r}")
    if hasattr(value, "item"):  # a 0-d tensor or NumPy scalar
        try:
            value = value.item()
        except (RuntimeError, ValueError) as error:
            raise TypeError(f"step {step}: metric {key!r} holds more than one number ({error})") from None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return value
    raise TypeError(f"step {step}: metric {key!r} is {type(value).__name__} {value!r}, not a number")


def _format(value: float) -> str:
    """A metric for the console: integers as they are, large values without decimals, else 4 digits."""
    if isinstance(value, int) or (math.isfinite(value) and abs(value) >= 1000):
        return f"{value:.0f}"
    return f"{value:.4g}"


def console_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    """``step 3/100 reward/mean=0.42 ... perf/step_s=3.21 (+N more in metrics.jsonl)``: the
    ``CONSOLE_FIRST`` keys the step has; every metric is in the JSONL file."""
    keys = [key for key in CONSOLE_FIRST if key in metrics]
    more = len(metrics) - len(keys)
    tail = [f"(+{more} more in {METRICS_FILE})"] if more else []
    return " ".join(
        [f"step {step}/{total_steps}", *(f"{key}={_format(metrics[key])}" for key in keys), *tail]
    )


class ConsoleSink(BaseMetricSink):
    """One line per step on stdout (above the progress bar): ``console_line``."""

    where = "stdout"

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        console.write(console_line(step, self.run.total_steps, metrics), sys.stdout)
