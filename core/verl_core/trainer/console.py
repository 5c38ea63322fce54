"""What a run says on the console besides its metric lines: start-up phases, resume, samples, the end.

Every line goes to stderr as ``verl-core: ...`` (stdout carries the metric lines, which a script may
parse), flushed at once, so that a run under a pipe or ``nox`` is never silent; while a progress bar
shows (``set_progress_bar``), above it, the bar redrawn under the line instead of written over.
``phase`` announces a start-up phase and says how long it took; ``say`` and ``warn`` print one
line; ``samples`` shows a few validation generations; ``summary`` is the end-of-run report.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

PREFIX = "verl-core: "
#: Characters of a prompt or response shown on the console (the run folder keeps them whole).
SHOWN_CHARS = 120

#: The progress bar on stderr while one shows (a tqdm bar: its ``write`` clears it, prints the line and
#: draws it again below), else None.
_bar: Any = None


def say(message: str) -> None:
    """One line on stderr, prefixed ``verl-core:``; above the progress bar while one shows."""
    bar = _bar
    if bar is not None:
        bar.write(PREFIX + message, file=sys.stderr)
        sys.stderr.flush()
    else:
        print(PREFIX + message, file=sys.stderr, flush=True)


def write(line: str, stream: TextIO) -> None:
    """``line`` as it is on ``stream`` (a metric line on stdout), above the progress bar while one shows."""
    bar = _bar
    if bar is not None:
        bar.write(line, file=stream)
    else:
        print(line, file=stream, flush=True)


def set_progress_bar(bar: Any) -> None:
    """From now on ``say`` prints above ``bar`` (a tqdm bar on stderr; ``MetricsLogger`` sets its own
    while it shows), or plain lines again with None."""
    global _bar
    _bar = bar


def warn(message: str) -> None:
    """One warning line on stderr."""
    say("warning: " + message)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """``verl-core: <what> ...`` before a start-up phase and ``... done in N s`` after it: no silence
    while Ray starts or engines load."""
    say(f"{what} ...")
    started = time.perf_counter()
    yield
    say(f"{what}: done in {time.perf_counter() - started:.1f} s")


def _short(text: Any) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def samples(step: int, rows: Sequence[Mapping[str, Any]], count: int = 2) -> None:
    """The first ``count`` validation generations of ``step``: prompt, response and score."""
    for row in rows[:count]:
        say(
            f"sample at step {step}: {_short(row['prompt'])!r} -> {_short(row['response'])!r} "
            f"(score {row['score']:.3g})"
        )


def summary(
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    seconds: float,
    steps: int,
    files: Sequence[str],
) -> None:
    """The end of a run: each of ``keys`` from its first to its last logged value, the wall time, the
    run's files."""
    say(f"done: {steps} step(s) in {_duration(seconds)}")
    for key in keys:
        logged = [(record["step"], record[key]) for record in records if record.get(key) is not None]
        if logged:
            (first_step, first), (last_step, last) = logged[0], logged[-1]
            say(f"  {key}: {first:.4g} at step {first_step} -> {last:.4g} at step {last_step}")
    for line in files:
        say(f"  {line}")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{int(hours)} h {int(minutes)} min"
    return f"{int(minutes)} min {seconds:.0f} s" if minutes else f"{seconds:.1f} s"
