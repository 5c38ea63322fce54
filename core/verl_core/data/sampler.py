"""Which prompts make each step's batch: ``EpochSampler``, every epoch a permutation seeded by
``(seed, epoch)`` alone, cut into full batches, so that a checkpoint needs only the epoch and the
position in it to resume exactly, and a state saved after an epoch's last batch resumes at the next
epoch's first (verl trains zero steps there, verl issue 7401); ``sequential_batches`` for validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from verl_core.data.dataset import FILTER_OVERLONG_KEY, PROMPT_LENGTH_KEY
from verl_core.errors import DataError
from verl_core.seeds import seeded_random

BATCH_SIZE_KEY = "data.train_batch_size"
#: Keys of ``EpochSampler.state_dict()``.
SAMPLER_STATE_KEYS: tuple[str, ...] = ("epoch", "position", "seed", "shuffle", "num_rows", "batch_size")


@attrs.frozen
class SamplerBatch:
    """One step's prompts: ``indices`` into the dataset, batch ``step_in_epoch`` of epoch ``epoch``
    (both from 0)."""

    epoch: int
    step_in_epoch: int
    indices: tuple[int, ...]


@attrs.define
class EpochSampler:
    """The order in which a dataset's rows make up the training batches, epoch after epoch.

    Each epoch is a permutation of ``range(num_rows)`` seeded by ``(seed, epoch)`` (its own
    ``random.Random``: the global RNGs are neither read nor advanced), or ``range(num_rows)`` itself
    without ``shuffle``, cut into ``steps_per_epoch = num_rows // batch_size`` full batches: the last
    ``num_rows % batch_size`` rows of each epoch's order are dropped (with ``shuffle``, different rows
    each epoch), so every step has exactly ``batch_size`` prompts.

    The state is ``(epoch, position)``: the next batch is batch ``position`` of epoch ``epoch``. After
    an epoch's last batch it is ``(epoch + 1, 0)`` at once, so a checkpoint taken at an epoch boundary
    resumes at the next epoch's first batch.
    """

    num_rows: int
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    #: The epoch of the next batch.
    epoch: int = attrs.field(default=0, init=False)
    #: The next batch's index in its epoch.
    position: int = attrs.field(default=0, init=False)
    _order: tuple[int, tuple[int, ...]] | None = attrs.field(default=None, init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.num_rows < 1:
            raise DataError("the dataset is empty (0 prompts after filtering): add prompts")
        if self.batch_size < 1:
            raise DataError(f"{BATCH_SIZE_KEY} must be > 0 prompts, got {self.batch_size}")
        if self.batch_size > self.num_rows:
            raise DataError(
                f"{BATCH_SIZE_KEY} ({self.batch_size}) is larger than the dataset ({self.num_rows} prompts "
                f"after filtering): lower {BATCH_SIZE_KEY} to at most {self.num_rows}, or add prompts"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full batches per epoch (the remainder of ``num_rows / batch_size`` is dropped)."""
        return self.num_rows // self.batch_size

    @property
    def steps_taken(self) -> int:
        """Batches handed out since epoch 0 began (the trainer's global step, when it takes one each)."""
        return self.epoch * self.steps_per_epoch + self.position

    def total_steps(self, epochs: int) -> int:
        """Steps in ``epochs`` whole epochs."""
        if epochs < 0:
            raise DataError(f"epochs must be >= 0, got {epochs}")
        return epochs * self.steps_per_epoch

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """Every row index once, in epoch ``epoch``'s order (depends on ``seed`` and ``epoch`` only)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        order = list(range(self.num_rows))
        if self.shuffle:
            seeded_random("verl_core.data.EpochSampler", self.seed, epoch).shuffle(order)
        self._order = (epoch, tuple(order))
        return self._order[1]

    def next_batch(self) -> SamplerBatch:
        """The next step's batch, and advance (into the next epoch after an epoch's last batch)."""
        start = self.position * self.batch_size
        batch = SamplerBatch(
            self.epoch, self.position, self.epoch_order(self.epoch)[start : start + self.batch_size]
        )
        self.position += 1
        if self.position == self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position and what the order depends on, as plain JSON-able data for a checkpoint."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of a sampler over the same dataset and batch size).

        A state at an epoch's end (``position == steps_per_epoch``) continues at the next epoch's first
        batch. A state made with another dataset size, batch size, seed or ``shuffle`` is an error:
        its position would mean other prompts.
        """
        if not isinstance(state, Mapping):
            raise DataError(
                f"sampler state is a {type(state).__name__}, not a mapping of {SAMPLER_STATE_KEYS}"
            )
        missing = [key for key in SAMPLER_STATE_KEYS if key not in state]
        if missing:
            raise DataError(
                f"sampler state lacks {', '.join(missing)}: it was not written by EpochSampler.state_dict() "
                "(the checkpoint is damaged or from another program)"
            )
        for key in SAMPLER_STATE_KEYS:
            expected = bool if key == "shuffle" else int
            value = state[key]
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                what = "a boolean" if expected is bool else "an integer"
                raise DataError(f"sampler state '{key}' is {value!r}, not {what}: the checkpoint is damaged")
        changed = {
            "num_rows": (
                f"the dataset had {state['num_rows']} prompts (after filtering) at the checkpoint and has "
                f"{self.num_rows} now: the dataset changed since the checkpoint (data.train_files, or what "
                f"filters it: {PROMPT_LENGTH_KEY}, {FILTER_OVERLONG_KEY}, the tokenizer); resume with the "
                "same data, or start fresh (trainer.resume_mode=disable)"
            ),
            "batch_size": (
                f"{BATCH_SIZE_KEY} was {state['batch_size']} at the checkpoint and is {self.batch_size} "
                f"now: the batch size changed since the checkpoint; set {BATCH_SIZE_KEY}="
                f"{state['batch_size']} to resume, or start fresh (trainer.resume_mode=disable)"
            ),
            "seed": (
                f"data.seed was {state['seed']} at the checkpoint and is {self.seed} now: set "
                f"data.seed={state['seed']} to resume the same order, or start fresh "
                "(trainer.resume_mode=disable)"
            ),
            "shuffle": (
                f"data.shuffle was {str(state['shuffle']).lower()} at the checkpoint and is "
                f"{str(self.shuffle).lower()} now: set data.shuffle={str(state['shuffle']).lower()} to "
                "resume the same order, or start fresh (trainer.resume_mode=disable)"
            ),
        }
        for key, message in changed.items():
            if state[key] != getattr(self, key):
                raise DataError(message)
        epoch, position = state["epoch"], state["position"]
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise DataError(
                f"sampler state epoch={epoch}, position={position} is out of range (epoch >= 0, position "
                f"in [0, {self.steps_per_epoch}]): the checkpoint is damaged"
            )
        if position == self.steps_per_epoch:
            epoch, position = epoch + 1, 0
        self.epoch, self.position = epoch, position


def sequential_batches(num_rows: int, batch_size: int | None) -> list[range]:
    """Validation batches: every row once, in order, ``batch_size`` at a time (the last one may be
    smaller); ``None``: all rows in one batch (``data.val_batch_size``)."""
    if batch_size is not None and batch_size < 1:
        raise DataError(f"data.val_batch_size must be > 0 prompts, got {batch_size}")
    if batch_size is None or batch_size >= num_rows:
        return [range(num_rows)] if num_rows else []
    return [range(start, min(start + batch_size, num_rows)) for start in range(0, num_rows, batch_size)]
