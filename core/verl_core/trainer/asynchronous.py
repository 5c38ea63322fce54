"""Asynchronous training: the rollout replicas generate the next batches while the actor trains.

``GenerationPipeline`` runs the trainer's ``collect`` (generate, score) for the steps ahead on a
thread of its own, into a buffer the trainer takes each step's batch from. Which weights generate
which batch is fixed by the config, never by timing: batch ``s`` comes from policy version
``source_version(s)`` = ``max(s - 1 - staleness, b)``, where ``b`` is the last barrier before ``s``
(the step the run started or resumed at, and every checkpointed step). So a run is reproducible,
``async`` with staleness 0 is ``sync``'s run bitwise, and a resumed run continues exactly as the
uninterrupted one: no batch after a checkpoint was generated from weights older than the checkpoint's.
The buffer holds at most ``staleness`` batches ahead of the one training (generating batch ``s``
needs version ``s - 1 - staleness``, published once step ``s - 1 - staleness`` has trained).

The trainer ``publish``es each version's weights after its update; the generation thread moves the
replicas to the version a batch needs before generating it (a version no batch needs any more is
released). Validation ``pause``s the thread between two batches to generate with the newest weights;
the thread then moves the replicas back to its batch's version.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from verl_core.workers.replicas import PublishedWeights, RolloutReplicas


def source_version(step: int, staleness: int, first_step: int, save_freq: int) -> int:
    """The policy version that generates batch ``step`` (see the module docstring): ``staleness``
    updates behind the policy it trains, never before the run's ``first_step`` or the last
    checkpointed step (every ``save_freq`` steps; 0 saves none) before ``step``."""
    barrier = first_step
    if save_freq:
        barrier = max(barrier, (step - 1) // save_freq * save_freq)
    return max(step - 1 - staleness, barrier)


@attrs.frozen
class ReadyBatch:
    """A generated batch: what ``collect`` returned, the policy version that generated it, how long
    the generation thread waited for that version before generating (``rollout_idle_s``), how long it
    generated (``generation_s``), and how many batches were ready when the trainer took it
    (``buffer_depth``, itself included)."""

    collected: Any
    version: int
    rollout_idle_s: float
    generation_s: float
    buffer_depth: int = 0
    #: How long the trainer waited for it.
    trainer_idle_s: float = 0.0


class GenerationPipeline:
    """Generates the batches of steps ``first_step + 1`` to ``total_steps`` on its own thread (see the
    module docstring). ``collect(step)`` makes one step's batch on the replicas; it is called in step
    order, on the generation thread only."""

    def __init__(
        self,
        collect: Callable[[int], Any],
        replicas: RolloutReplicas,
        *,
        first_step: int,
        total_steps: int,
        staleness: int,
        save_freq: int,
        partial_rollout: bool = False,
    ):
        self._collect = collect
        self.replicas = replicas
        self.first_step, self.total_steps = first_step, total_steps
        self.staleness, self.save_freq = staleness, save_freq
        self.partial_rollout = partial_rollout
        self._weights: dict[int, PublishedWeights] = {}
        self._ready: dict[int, ReadyBatch] = {}
        self._failure: BaseException | None = None
        self._stopping = False
        self._changed = threading.Condition()
        #: Held while the thread uses the replicas (a batch), and by ``pause``.
        self._replicas_turn = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="generation", daemon=True)

    def version_for(self, step: int) -> int:
        return source_version(step, self.staleness, self.first_step, self.save_freq)

    # -- the trainer's side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def publish(self, version: int, weights: PublishedWeights) -> None:
        """The weights of policy ``version`` (after step ``version``'s update; ``first_step``'s before
        the first)."""
        with self._changed:
            self._weights[version] = weights
            self._changed.notify_all()

    def take(self, step: int) -> ReadyBatch:
        """Batch ``step``, once generated; what the generation thread raised, if it failed (a
        ``WorkerError`` naming a replica that died, a reward function's error naming the sample)."""
        started = time.perf_counter()
        with self._changed:
            while step not in self._ready and self._failure is None:
                self._changed.wait()
            if step not in self._ready:
                raise self._failure
            ready = self._ready.pop(step)
            depth = 1 + len(self._ready)
        return attrs.evolve(ready, buffer_depth=depth, trainer_idle_s=time.perf_counter() - started)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the replicas between two of the thread's batches (validation generates meanwhile)."""
        with self._replicas_turn:
            yield

    def newer(self, step: int, current: int | None) -> tuple[int, PublishedWeights] | None:
        """With partial rollouts: the newest published weights that batch ``step`` may move to (newer
        than ``current``, not newer than the policy it trains), or None."""
        with self._changed:
            usable = [v for v in self._weights if (current is None or v > current) and v <= step - 1]
            return (max(usable), self._weights[max(usable)]) if usable else None

    def weights(self, version: int) -> PublishedWeights:
        """The published weights of ``version`` (the newest are kept until a newer one is needed)."""
        with self._changed:
            return self._weights[version]

    def close(self) -> None:
        """Stop the thread after its current call (the replicas' shutdown ends a call in flight)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    # -- the generation thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for step in range(self.first_step + 1, self.total_steps + 1):
                version = self.version_for(step)
                waited = time.perf_counter()
                with self._changed:
                    while version not in self._weights and not self._stopping:
                        self._changed.wait()
                    if self._stopping:
                        return
                    if self.partial_rollout:  # the newest weights the batch may use, from the start
                        version = max(v for v in self._weights if version <= v <= step - 1)
                    weights = self._weights[version]
                    for old in [old for old in self._weights if old < version]:
                        del self._weights[old]  # no later batch needs it
                waited = time.perf_counter() - waited
                with self._replicas_turn:
                    started = time.perf_counter()
                    if self.replicas.version != version:
                        self.replicas.update_weights(weights, version)
                    collected = self._collect(step)
                    generation_s = time.perf_counter() - started
                with self._changed:
                    self._ready[step] = ReadyBatch(collected, version, waited, generation_s)
                    self._changed.notify_all()
        except BaseException as error:  # the trainer raises it from take()
            with self._changed:
                self._failure = error
                self._changed.notify_all()
