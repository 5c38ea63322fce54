"""Reproducible randomness: the same initial weights on every rank, whatever each rank did before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from verl_core.toolkit.checkpoint import load_checkpoint_file


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


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random generator states, for a checkpoint: the CPU generator, and the current
    CUDA device's once CUDA is in use."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what ``rng_state`` returned (the CUDA part only where CUDA is available)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


#: One file per rank in a checkpoint directory: each rank's generators differ (dropout, sampling).
RNG_FILE = "rng_rank{rank}.pt"


def save_rng_state(directory: Path, rank: int) -> None:
    """Write this rank's generator states into a checkpoint's (staging) directory."""
    torch.save(rng_state(), directory / RNG_FILE.format(rank=rank))


def load_rng_state(directory: Path, rank: int) -> bool:
    """Restore this rank's generator states from ``directory``; ``False`` when it has none (resuming
    on more ranks than were saved: the extra ranks keep their own)."""
    rng_file = directory / RNG_FILE.format(rank=rank)
    if not rng_file.is_file():
        return False
    set_rng_state(load_checkpoint_file(directory, rng_file.name))
    return True
