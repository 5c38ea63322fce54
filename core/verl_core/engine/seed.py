"""Reproducible randomness: the same initial weights on every rank, whatever each rank did before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU random generator seeded to ``seed``, then restore its state.

    Use it around model construction: freshly initialised weights (a new value head) come out
    identical on every rank and do not disturb the caller's random stream. Models are built on CPU
    and moved afterwards, so only the CPU generator matters.
    """
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        yield
