"""How long each phase of a training step took, the step's throughput, and this process's peak memory.

The trainer times the phases of a step with ``Timer.phase`` (``timing/generate``, ...) and adds
``perf_metrics`` (tokens per second, peak memory) to the step's metrics. Importing this module imports
no torch: CUDA is asked only in a process that uses it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs

#: A phase's wall seconds are logged as ``timing/<phase>``.
TIMING_PREFIX = "timing/"
#: The wall seconds of the whole step.
STEP_TIME_KEY = "perf/step_s"
#: Throughput: the step's generated (response) tokens, padding excluded, per wall second of the step.
TOKENS_PER_S_KEY = "perf/tokens_per_s"
#: This process's peak memory so far, in MiB (``peak_memory``).
PEAK_MEMORY_KEY = "perf/peak_memory_mib"
#: Bytes in a MiB.
MIB = 1024 * 1024


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
    ``step_metrics`` adds what every step logs; ``reset()`` starts the next step.
    """

    timings: dict[str, float] = attrs.field(factory=dict)
    #: When the step began (``time.perf_counter()``): at creation, and again at ``reset()``.
    started: float = attrs.field(init=False, factory=time.perf_counter)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a ``with`` block as the phase ``name`` (see the module function ``phase``)."""
        return phase(name, self.timings)

    def metrics(self) -> dict[str, float]:
        """The step's timings so far: ``{"timing/generate": seconds, ...}``."""
        return dict(self.timings)

    def step_metrics(self, response_mask: Any, epoch: int) -> dict[str, float]:
        """What every step logs after its own metrics, RL and SFT alike: the phases, ``training/epoch``,
        ``response_length/mean`` (``response_mask``'s tokens per sequence), the step's wall seconds
        since it began (``perf/step_s``) and ``perf_metrics`` of its response tokens."""
        seconds = time.perf_counter() - self.started
        response_tokens = int(response_mask.sum())
        return self.metrics() | {
            "training/epoch": float(epoch),
            "response_length/mean": response_tokens / response_mask.shape[0],
            STEP_TIME_KEY: seconds,
            **perf_metrics(response_tokens, seconds),
        }

    def reset(self) -> None:
        self.timings.clear()
        self.started = time.perf_counter()


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
