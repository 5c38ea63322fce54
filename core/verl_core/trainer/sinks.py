"""Metric sinks: where a run's metrics go besides ``RUN_DIR/metrics.jsonl``, and how a failing or slow
one is kept from the training loop.

``trainer.logger`` names sinks of the registry (``verl-core plugins --all`` lists them; core's are
``console``, ``tensorboard``, ``wandb``, ``mlflow`` and ``trackio``, see docs/tracking.md). Each is a
``BaseMetricSink`` subclass, made with the run's ``SinkRun`` when training starts; it receives every
step's scalars (``log_metrics``), the validation samples as rows (``log_samples``) and the curves'
picture at the end (``log_artifact``).

A ``SinkChannel`` carries one sink's records:

- a ``background`` sink (every tracker) is made and fed in a thread of its own behind a queue of at
  most ``QUEUE_SIZE`` records. The trainer only puts a record in the queue: a tracker whose server
  answers slowly, or retries, never holds a step. A queue that is full (a tracker far behind) drops the
  newest record, with one warning; waiting instead would slow training, and an unbounded queue would
  grow without limit while a server hangs. ``close`` waits at most ``CLOSE_TIMEOUT_S`` for the rest;
- a sink that raises (a server gone, a disk full, a package that fails to start) is named in one
  warning, with where it writes (``BaseMetricSink.where``: its URL or folder), and dropped for the rest
  of the run: training goes on, and ``metrics.jsonl`` keeps every step. It is not retried: a tracker's
  client retries its own requests already, and a retried record may land twice;
- each background sink keeps ``RUN_DIR/tracking/<name>.json``: the tracker's run id and the last step
  it accepted. A resumed run (from a checkpoint at step ``S``) gives the sink that run id to continue
  (``SinkRun.resume_id``), sends first the steps of ``metrics.jsonl`` up to ``S`` that it had not
  accepted yet, and skips the steps it had (the steps after ``S`` trained again by the resumed run):
  no step missing, none twice. A fresh run starts a new tracker run.
"""

from __future__ import annotations

import abc
import json
import math
import os
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from verl_core.trainer import console
from verl_core.trainer.run_files import METRICS_FILE, TENSORBOARD_DIR, TRACKING_DIR, read_records

#: Records a background sink may hold unsent before new ones are dropped (with a warning).
QUEUE_SIZE = 1024
#: How long closing the run waits for a background sink to send what it holds, in seconds.
CLOSE_TIMEOUT_S = 60.0


@attrs.frozen
class SinkRun:
    """What a sink knows of the run it records, when it is made."""

    #: The run folder (``trainer.run_dir``).
    run_dir: Path
    #: The tracker's project (``trainer.project_name``) and the run's name in it
    #: (``trainer.experiment_name``, by default the run folder's name).
    project: str
    name: str
    #: ``trainer.tracking_uri``: the tracking server or store of the sinks that use one (``mlflow``);
    #: ``None``: the sink's own default.
    tracking_uri: str | None
    #: The resolved run config as plain data (the tracker's parameters).
    config: Mapping[str, Any]
    #: The step the run resumes after (0 for a fresh run), and the run's last step.
    start_step: int
    total_steps: int
    #: The tracker's id of the run this one continues (kept in ``RUN_DIR/tracking/<name>.json``);
    #: ``None``: start a new tracker run.
    resume_id: str | None = None


class BaseMetricSink(abc.ABC):
    """A metric sink (see the module docstring). Subclasses implement ``log_metrics``, and set
    ``run_id`` when their tracker has ids (it is kept for a resumed run) and ``where``.

    Any method may raise: the sink is then dropped for the rest of the run with one warning naming it
    and ``where``. ``close`` is called once at the end, also after a failure where the sink was made.
    """

    #: Where the sink writes, for its warnings: a tracking server's URL, a folder.
    where: str = ""
    #: The tracker's id of this run, kept in the run folder so that a resumed run continues it.
    run_id: str | None = None

    def __init__(self, run: SinkRun) -> None:
        self.run = run

    @abc.abstractmethod
    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``step``'s scalars (finite numbers; a value that is not finite is left out)."""

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record the validation samples of ``step`` (``prompt``, ``response``, ``score``, ...)."""
        del step, rows

    def log_artifact(self, path: Path) -> None:
        """Keep the file ``path`` (the curves' PNG) with the run."""
        del path

    def close(self) -> None:  # noqa: B027 - a sink without a run to finish need not override it
        """Finish the tracker's run; called once at the end of training."""


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``config`` as ``{"actor.engine.optim.lr": 1e-5, ...}``: nested sections flattened with dots,
    lists and ``None`` as their JSON text (trackers' parameters are flat scalars)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= flat_params(value, name + ".")
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def finite(metrics: Mapping[str, float]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if math.isfinite(value)}


# -- TensorBoard ------------------------------------------------------------------------------------


class TensorBoardSink(BaseMetricSink):
    """TensorBoard scalars under ``RUN_DIR/tensorboard/``; a resumed run hides the events of the steps
    after its checkpoint (``purge_step``)."""

    def __init__(self, run: SinkRun) -> None:
        super().__init__(run)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            from verl_core.errors import VerlCoreError

            raise VerlCoreError(
                f"trainer.logger names 'tensorboard', but TensorBoard cannot be imported ({error}): "
                'pip install tensorboard (or pip install "verl-core[tensorboard]"), or remove '
                "'tensorboard' from trainer.logger"
            ) from error
        log_dir = run.run_dir / TENSORBOARD_DIR
        self.where = str(log_dir)
        self._writer = SummaryWriter(
            log_dir=str(log_dir), purge_step=run.start_step + 1 if run.start_step else 0
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# -- carrying records to a sink ---------------------------------------------------------------------

_CLOSE = object()


class SinkChannel:
    """One sink of a run (``name`` in ``trainer.logger``) and how its records reach it: in the caller's
    thread, or through a bounded queue in a thread of its own (``background``). Its failures are warned
    about once and end it; nothing it does raises into the caller after it was made."""

    def __init__(
        self, name: str, factory: Callable[[SinkRun], BaseMetricSink], run: SinkRun, background: bool
    ):
        self.name, self.background = name, background
        self.state_path = run.run_dir / TRACKING_DIR / f"{name}.json"
        self._sent_through = -1  # steps up to this one the tracker has already (a resumed run's)
        backlog: list[dict[str, Any]] = []
        if background:
            state = self._read_state() if run.start_step > 0 else {}
            if state:
                run = attrs.evolve(run, resume_id=state.get("run_id"))
                self._sent_through = int(state.get("last_step", -1))
                backlog = [
                    record
                    for record in read_records(run.run_dir / METRICS_FILE)
                    if self._sent_through < record["step"] <= run.start_step
                ]
            else:
                self.state_path.unlink(missing_ok=True)  # a fresh run: a new tracker run
        self.sink: BaseMetricSink | None = None
        self.failed = False
        self._warned_full = False
        if not background:
            self.sink = factory(run)  # an inline sink that cannot start is the caller's error
            return
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_SIZE)
        for record in backlog:
            step = record.pop("step")
            self._queue.put_nowait(("log_metrics", step, record))
        self._thread = threading.Thread(
            target=self._serve, args=(factory, run), name=f"verl-core sink {name}", daemon=True
        )
        self._thread.start()

    # -- the caller's side

    def send(self, method: str, step: int | None, payload: Any) -> None:
        """Hand ``sink.<method>(step, payload)`` (``step`` None: ``sink.<method>(payload)``) to the sink."""
        if self.failed or (step is not None and step <= self._sent_through):
            return
        if not self.background:
            self._call(method, step, payload)
            return
        try:
            self._queue.put_nowait((method, step, payload))
        except queue.Full:
            if not self._warned_full:
                self._warned_full = True
                console.warn(
                    f"metric sink '{self.name}' falls behind ({QUEUE_SIZE} records unsent); it misses "
                    f"records from step {step} on while it catches up ({METRICS_FILE} has every step)"
                )

    def close(self) -> None:
        """Finish the sink: send what it holds (a background one: waiting at most ``CLOSE_TIMEOUT_S``)
        and close it."""
        if not self.background:
            if self.sink is not None:
                self._call("close", None, None)
                self.sink = None
            return
        try:
            self._queue.put(_CLOSE, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            console.warn(
                f"metric sink '{self.name}'{self._where()} did not finish within {CLOSE_TIMEOUT_S:.0f} s; "
                "left behind: its last records may be missing there"
            )

    # -- the sink's side

    def _serve(self, factory: Callable[[SinkRun], BaseMetricSink], run: SinkRun) -> None:
        try:
            self.sink = factory(run)
        except Exception as error:  # noqa: BLE001 - a sink never stops training (a Ctrl-C still does)
            self._fail("could not start", error)
        else:
            self._write_state(self._sent_through)
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                break
            if not self.failed:
                self._call(*item)
        if self.sink is not None:
            self._call("close", None, None)

    def _call(self, method: str, step: int | None, payload: Any) -> None:
        sink = self.sink
        if sink is None or self.failed:
            return
        try:
            if step is None:
                getattr(sink, method)(*(() if payload is None else (payload,)))
            else:
                getattr(sink, method)(step, payload)
        except Exception as error:  # noqa: BLE001 - a sink never stops training; a Ctrl-C that lands
            # while a foreground sink writes is the user's, not the sink's: it stops the run
            self._fail(f"failed in {method}" + (f" at step {step}" if step is not None else ""), error)
            if method != "close":
                try:
                    sink.close()
                except Exception:  # noqa: BLE001, S110 - already failing, already warned
                    pass
            return
        if method == "log_metrics" and self.background:
            self._write_state(step)

    def _fail(self, what: str, error: BaseException) -> None:
        self.failed = True
        detail = " ".join(f"{type(error).__name__}: {error}".split())[:500]
        console.warn(
            f"metric sink '{self.name}'{self._where()} {what} ({detail}); it records nothing more in this "
            f"run, training goes on ({METRICS_FILE} in the run folder has every step)"
        )

    def _where(self) -> str:
        where = self.sink.where if self.sink is not None else ""
        return f" ({where})" if where else ""

    def _read_state(self) -> dict[str, Any]:
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _write_state(self, step: int | None) -> None:
        """Keep the tracker's run id and the last step it accepted, for a resumed run (atomically)."""
        state = {"run_id": self.sink.run_id if self.sink is not None else None, "last_step": step}
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.state_path.with_suffix(".json.partial")
            partial.write_text(json.dumps(state), encoding="utf-8")
            os.replace(partial, self.state_path)
        except OSError as error:
            self._fail("could not keep its state", error)
