"""A training run's feedback: how long each phase of a step took, throughput and peak memory, and the
sinks that show and keep every step's metrics.

The trainer times the phases of a step with ``Timer.phase`` (``timing/generate``, ...), adds
``perf_metrics`` (tokens per second, peak memory) and hands the step's metrics to
``MetricsLogger.log``, which

- appends one JSON object to ``RUN_DIR/metrics.jsonl``, always: ``verl-core plot`` redraws the curves
  from it, and a resumed run continues it;
- prints one line when ``console`` is in ``trainer.logger``;
- writes TensorBoard scalars under ``RUN_DIR/tensorboard/`` when ``tensorboard`` is;
- moves a progress bar (step/total, reward, tokens/s, ETA) on stderr when that is a terminal, and
  otherwise, when no console line is printed either, writes a plain progress line every tenth of the
  run (and at least every ``PROGRESS_EVERY_S`` seconds), so that a run under a pipe is never silent.

The trainer, the console line, the progress bar and the plot agree on the metric keys through the
``*_KEY`` constants below; docs/training.md ("Metrics, logs and plots") lists every key and the run folder's layout.
Importing this module imports neither torch nor tqdm: each sink loads what it needs when it is made.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import attrs

from verl_core.errors import ConfigError, VerlCoreError

#: The run folder's file of metrics: one JSON object per line, ``{"step": N, "<key>": value, ...}``.
METRICS_FILE = "metrics.jsonl"
#: The run folder's folder of TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: The run folder's folder of a few generations per validation, ``step_<N>.jsonl``.
VALIDATION_DIR = "validation"
#: The metric sinks ``trainer.logger`` may name; ``metrics.jsonl`` is written whatever it names.
LOGGERS: tuple[str, ...] = ("console", "tensorboard")

#: The mean score of the step's responses as the reward function gave them (before any KL penalty).
REWARD_KEY = "reward/mean"
#: The mean validation score over every validation prompt (``validation.summarize``).
VAL_SCORE_KEY = "val/score/mean"
#: The actor's policy loss and the critic's value loss, averaged over the step's updates.
ACTOR_LOSS_KEY = "actor/loss"
CRITIC_LOSS_KEY = "critic/loss"
#: A phase's wall seconds are logged as ``timing/<phase>``.
TIMING_PREFIX = "timing/"
#: The wall seconds of the whole step.
STEP_TIME_KEY = "perf/step_s"
#: Throughput: the step's generated (response) tokens, padding excluded, per wall second of the step.
TOKENS_PER_S_KEY = "perf/tokens_per_s"
#: This process's peak memory so far, in MiB (``peak_memory``).
PEAK_MEMORY_KEY = "perf/peak_memory_mib"
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
#: Bytes in a MiB.
MIB = 1024 * 1024
#: Without a terminal and without console lines, a progress line at least this often (seconds).
PROGRESS_EVERY_S = 30.0


# -- timings, throughput, memory ------------------------------------------------------------------


def _cuda() -> Any:
    """``torch.cuda`` when this process uses CUDA (it initialised it), else ``None``; never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda


@contextlib.contextmanager
def phase(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the wall seconds of the ``with`` block to ``timings["timing/<name>"]``.

    Repeated blocks of one name add up (one update per PPO epoch), and a block that raises still
    counts. When this process uses CUDA, the GPU's queued work is waited for at both ends, so that a
    phase is charged for the kernels it launched, not for launching them.
    """
    cuda = _cuda()
    if cuda is not None:
        cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda is not None:
            cuda.synchronize()
        key = TIMING_PREFIX + name
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


@attrs.define
class Timer:
    """The wall seconds of each phase of one step, keyed ``timing/<phase>``.

    ``with timer.phase("generate"): ...`` times a phase; ``timer.metrics()`` is what to log;
    ``reset()`` starts the next step.
    """

    timings: dict[str, float] = attrs.field(factory=dict)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a ``with`` block as the phase ``name`` (see the module function ``phase``)."""
        return phase(name, self.timings)

    def metrics(self) -> dict[str, float]:
        """The step's timings so far: ``{"timing/generate": seconds, ...}``."""
        return dict(self.timings)

    def reset(self) -> None:
        self.timings.clear()


def peak_memory() -> float:
    """This process's peak memory so far, in MiB.

    With CUDA in use (initialised in this process): ``torch.cuda.max_memory_allocated()`` of the
    current GPU, since the start or the last ``torch.cuda.reset_peak_memory_stats()``. Otherwise the
    peak resident set size from ``resource.getrusage`` (for the whole run: it cannot be reset).
    Workers in other processes (Ray actors) are not counted. NaN where neither can be read.
    """
    cuda = _cuda()
    if cuda is not None:
        return cuda.max_memory_allocated() / MIB
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def tokens_per_s(tokens: int, seconds: float) -> float:
    """Throughput: ``tokens / seconds``; 0.0 when no time was measured."""
    return tokens / seconds if seconds > 0 else 0.0


def perf_metrics(tokens: int, seconds: float) -> dict[str, float]:
    """A step's ``perf/tokens_per_s`` (``tokens`` in ``seconds``) and ``perf/peak_memory_mib``."""
    return {TOKENS_PER_S_KEY: tokens_per_s(tokens, seconds), PEAK_MEMORY_KEY: peak_memory()}


# -- the metric sinks -----------------------------------------------------------------------------


def check_loggers(loggers: str | Iterable[str]) -> tuple[str, ...]:
    """``trainer.logger`` as a tuple of known sink names, or a ``ConfigError`` at ``trainer.logger``
    naming each unknown one with the close match."""
    names = (loggers,) if isinstance(loggers, str) else tuple(loggers)
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        from verl_core.config.validators import unknown_choice_message  # config loads cattrs and yaml

        note = f"{METRICS_FILE} in the run folder is written in any case"
        raise ConfigError(
            [("trainer.logger", unknown_choice_message("logger", name, LOGGERS, note)) for name in unknown]
        )
    return names


class MetricsLogger:
    """Every step's metrics to ``run_dir/metrics.jsonl`` and the sinks ``loggers`` names.

    ``loggers`` is ``trainer.logger`` (see ``LOGGERS``); ``total_steps`` the run's length, for the
    console line and the progress bar. ``start_step`` is the step the run resumes after (the
    checkpoint's step), 0 for a fresh run: lines of later steps already in ``metrics.jsonl`` are
    dropped, so that the steps the resumed run repeats are not there twice, and a fresh run starts
    the file over. TensorBoard hides its events of those steps likewise (``purge_step``).

    The progress bar is shown on stderr when ``show_progress`` is true and stderr is a terminal, and
    always with ``force_progress``. Call ``close()`` at the end, or use the logger as a context manager.
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
    ) -> None:
        self.loggers = check_loggers(loggers)
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        # TensorBoard first: a missing package fails before any file is touched.
        self._writer = (
            _tensorboard_writer(
                self.run_dir / TENSORBOARD_DIR, purge_step=start_step + 1 if start_step else 0
            )
            if "tensorboard" in self.loggers
            else None
        )
        self._file: TextIO | None = None
        self._bar: Any = None
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.truncate_after(start_step if start_step > 0 else -1)
        except BaseException:
            self.close()
            raise
        if force_progress or (show_progress and sys.stderr.isatty()):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, unit="step", file=sys.stderr, dynamic_ncols=True
            )
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
        """Record the metrics of ``step``: one line in ``metrics.jsonl`` (flushed), the console line,
        TensorBoard scalars, the progress bar.

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
            self._write(f"note: step {step}: {listed}: written as null in {self.path}", sys.stderr)
        if "console" in self.loggers:
            self._write(console_line(step, self.total_steps, values), sys.stdout)
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
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

    def _write(self, line: str, stream: TextIO) -> None:
        """``line`` on ``stream``, above the progress bar if there is one."""
        if self._bar is not None:
            self._bar.write(line, file=stream)
        else:
            print(line, file=stream, flush=True)

    def close(self) -> None:
        """Close the JSONL file, the TensorBoard writer and the progress bar; closing twice is fine."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _tensorboard_writer(log_dir: Path, purge_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise VerlCoreError(
            f"trainer.logger names 'tensorboard', but TensorBoard cannot be imported ({error}): "
            'pip install tensorboard (or pip install "verl-core[tensorboard]"), or remove '
            "'tensorboard' from trainer.logger"
        ) from error
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


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


# -- JSONL files ----------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    """The objects of a metrics JSONL file, in order (none if it does not exist).

    A last line without its newline that does not parse is a write cut short by a crash, and is
    left out; any other line that is not a JSON object with an integer ``step`` is a ``VerlCoreError``
    naming the file and the line.
    """
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the last line, without its newline: a crash mid-write
                continue
            raise VerlCoreError(f"{path}:{number}: not JSON ({error}); repair or delete that line") from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise VerlCoreError(
                f'{path}:{number}: not a metrics line (a JSON object with an integer "step"); '
                "repair or delete that line"
            )
        records.append(record)
    return records


def _jsonable(value: Any) -> Any:
    """``value`` with every NaN or infinity, however deep in lists and dicts, as ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


def write_jsonl(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``records`` to ``path``, one JSON object per line, and return the path.

    Parent folders are made; the file is replaced atomically (a crash leaves the old file or the new
    one, never half of one). Text stays readable (no ``\\u`` escapes); NaN and infinities become
    ``null``. The trainer writes validation generations with it to ``validation_samples_path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(_jsonable(dict(record)), ensure_ascii=False, allow_nan=False) + "\n")
    os.replace(partial, path)
    return path


def validation_samples_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Where the generations of the validation at ``step`` go: ``run_dir/validation/step_<step>.jsonl``."""
    return Path(run_dir) / VALIDATION_DIR / f"step_{step}.jsonl"
