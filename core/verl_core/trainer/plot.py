"""A run's curves: training reward, validation score and losses against the step, drawn from
``RUN_DIR/metrics.jsonl`` into ``RUN_DIR/curves.png``; and several runs' validation scores side by
side, against the step and against the training seconds (``plot_comparison``).

The trainer calls ``plot_run`` when a run ends; ``verl-core plot RUN_DIR`` redraws the picture from
the JSONL file whenever asked, during a run too (it reads the steps flushed so far). Each panel draws
the metric keys listed in ``PANELS``; a panel whose keys no line has is left out, so that a GRPO run
(no critic) or one without validation still gets a picture. matplotlib is imported only to draw, on
a figure of its own with the Agg canvas: no display is needed, and a caller's pyplot backend is left
as it was.
"""

from __future__ import annotations

import bisect
import fnmatch
import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from verl_core.errors import VerlCoreError
from verl_core.trainer.metrics import ACTOR_LOSS_KEY, CRITIC_LOSS_KEY, REWARD_KEY, VAL_SCORE_KEY
from verl_core.trainer.run_files import METRICS_FILE, read_records

#: The picture's file in the run folder.
PLOT_FILE = "curves.png"
#: Inches per panel (width, height) and the picture's resolution.
PANEL_SIZE = (6.0, 3.5)
DPI = 100
#: Panels per row.
COLUMNS = 2
#: Series with at most this many points get a marker on each (validation runs every few steps).
MARKER_MAX_POINTS = 50


@attrs.frozen
class Panel:
    """One panel of ``curves.png``: a title, and the metric keys drawn in it as ``fnmatch`` patterns
    (one line per matching key, in pattern order, matches of one pattern sorted)."""

    title: str
    keys: tuple[str, ...]

    def matching(self, keys: Sequence[str]) -> list[str]:
        """The keys among ``keys`` this panel draws, in its order."""
        return [key for pattern in self.keys for key in sorted(fnmatch.filter(keys, pattern))]


#: The panels of ``curves.png``, in order. ``val/pass@*`` is the overall pass@k of
#: ``validation.summarize`` (``val/pass@4``); per-data-source metrics are left to TensorBoard. An SFT
#: run (``verl_core.trainer.sft``) logs only the last panel's keys: its training and validation loss.
PANELS: tuple[Panel, ...] = (
    Panel("training reward", (REWARD_KEY,)),
    Panel("validation score", (VAL_SCORE_KEY, "val/pass@*")),
    Panel("actor loss", (ACTOR_LOSS_KEY,)),
    Panel("critic loss", (CRITIC_LOSS_KEY,)),
    Panel("SFT loss", ("sft/loss", "val/loss")),
)


def plot_run(run_dir: str | os.PathLike[str]) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into ``run_dir/curves.png`` and return the PNG's path.

    A missing or empty metrics file, a malformed line, or metrics with none of the keys of
    ``PANELS`` is a ``VerlCoreError`` naming the file; so is matplotlib missing.
    """
    run_dir = Path(run_dir)
    source = run_dir / METRICS_FILE
    if not source.is_file():
        what = "is not a folder" if not run_dir.is_dir() else f"holds no {METRICS_FILE}"
        raise VerlCoreError(
            f"{source}: no such file: {run_dir} {what}; give the run folder of a training run, where "
            f"the trainer writes {METRICS_FILE}"
        )
    records = read_records(source)
    if not records:
        raise VerlCoreError(f"{source}: no metrics in it yet; plot once the run has logged a step")
    path = run_dir / PLOT_FILE
    draw_curves(records, path, title=str(run_dir), source=str(source))
    return path


def draw_curves(
    records: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    title: str = "",
    source: str = "the metrics",
) -> tuple[str, ...]:
    """Draw the panels of ``PANELS`` that ``records`` (``metrics.jsonl`` lines) have data for into the
    PNG ``path`` (replaced atomically), and return the titles of the panels drawn.

    A ``null`` value (a NaN or infinity when logged) leaves a gap in its line. Metrics with none of
    the panels' keys are a ``VerlCoreError`` naming ``source``.
    """
    keys = sorted({key for record in records for key in record if key != "step"})
    drawn = [(panel, panel.matching(keys)) for panel in PANELS]
    drawn = [(panel, matched) for panel, matched in drawn if matched]
    if not drawn:
        wanted = ", ".join(pattern for panel in PANELS for pattern in panel.keys)
        raise VerlCoreError(f"{source}: nothing to plot: no line has any of the keys {wanted}")
    figure_class, canvas_class, integer_ticks = _matplotlib()
    rows = math.ceil(len(drawn) / COLUMNS)
    columns = min(len(drawn), COLUMNS)
    figure = figure_class(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), layout="constrained")
    canvas_class(figure)
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    for ax, (panel, matched) in zip(axes, drawn, strict=False):
        for key in matched:
            steps, values = _series(records, key, source)
            marker = "o" if len(steps) <= MARKER_MAX_POINTS else None
            ax.plot(steps, values, marker=marker, markersize=3, label=key)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(integer_ticks(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    for ax in axes[len(drawn) :]:  # the rest of the last row
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    _save(figure, path)
    return tuple(panel.title for panel, _ in drawn)


def plot_comparison(run_dirs: Sequence[str | os.PathLike[str]], path: str | os.PathLike[str]) -> Path:
    """The validation score (``val/score/mean``) of each of ``run_dirs`` against the step and against the
    training seconds (the sum of ``perf/step_s`` up to that step: validation time left out, which the
    runs of one comparison spend alike), one line per run named by its folder as given, into the PNG ``path``.
    A run folder without metrics or without validation scores is a ``VerlCoreError`` naming it."""
    runs = {}
    for run_dir in run_dirs:
        source = Path(run_dir) / METRICS_FILE
        if not source.is_file():
            raise VerlCoreError(f"{source}: no such file: give the run folders of training runs")
        runs[str(run_dir)] = validation_series(read_records(source), str(source))
    figure_class, canvas_class, integer_ticks = _matplotlib()
    figure = figure_class(figsize=(PANEL_SIZE[0] * 2, PANEL_SIZE[1]), layout="constrained")
    canvas_class(figure)
    by_step, by_second = figure.subplots(1, 2)
    for label, (steps, scores, seconds) in runs.items():
        by_step.plot(steps, scores, marker="o", markersize=3, label=label)
        by_second.plot(seconds, scores, marker="o", markersize=3, label=label)
    by_step.set_xlabel("step")
    by_step.xaxis.set_major_locator(integer_ticks(integer=True))
    by_second.set_xlabel("training seconds")
    for ax in (by_step, by_second):
        ax.set_title(f"validation score ({VAL_SCORE_KEY})")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    return _save(figure, path)


def _save(figure: Any, path: str | os.PathLike[str]) -> Path:
    """``figure`` as the PNG ``path``, replaced atomically."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    figure.savefig(partial, format="png", dpi=DPI)
    os.replace(partial, path)
    return path


def validation_series(
    records: Sequence[dict[str, Any]], source: str
) -> tuple[list[int], list[float], list[float]]:
    """A run's validation steps, its scores there and the training seconds by then (the sum of
    ``perf/step_s`` over the steps up to each, 0 before the first); a ``VerlCoreError`` naming
    ``source`` when it has no validation score."""
    steps, scores = _series(records, VAL_SCORE_KEY, source)
    if not steps:
        raise VerlCoreError(
            f"{source}: no {VAL_SCORE_KEY} to compare: the run never validated (trainer.test_freq)"
        )
    trained, seconds = _series(records, "perf/step_s", source)
    cumulative = list(itertools.accumulate(0.0 if math.isnan(value) else value for value in seconds))
    at = [bisect.bisect_right(trained, step) for step in steps]  # training steps done by then
    return steps, scores, [cumulative[done - 1] if done else 0.0 for done in at]


def _series(records: Sequence[dict[str, Any]], key: str, source: str) -> tuple[list[int], list[float]]:
    """The steps that logged ``key`` and its values there, ``null`` as NaN (a gap in the line)."""
    steps, values = [], []
    for record in records:
        if key not in record:
            continue
        value = record[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise VerlCoreError(
                f"{source}: step {record['step']}: {key} is {value!r}, not a number; repair that line"
            )
        steps.append(record["step"])
        values.append(math.nan if value is None else float(value))
    return steps, values


def _matplotlib() -> tuple[Any, Any, Any]:
    """matplotlib's ``Figure``, Agg canvas and ``MaxNLocator`` classes, or a ``VerlCoreError`` saying
    how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as error:
        raise VerlCoreError(
            f"drawing {PLOT_FILE} needs matplotlib, which cannot be imported ({error}): "
            "pip install 'matplotlib>=3.7' (a dependency of verl-core: reinstalling verl-core brings it)"
        ) from error
    return Figure, FigureCanvasAgg, MaxNLocator
