"""Atomic checkpoint directories: a crash at any point of a save leaves a complete checkpoint."""

from __future__ import annotations

import os
import re

import pytest

from verl_core.engine import checkpoint
from verl_core.engine.checkpoint import (
    MARKER_FILE,
    CheckpointError,
    CheckpointInfo,
    atomic_checkpoint,
    open_checkpoint,
)


class Crash(Exception):
    """Stands in for the process dying."""


def save(path, content: str, step: int) -> None:
    with atomic_checkpoint(path, global_step=step, backend="test") as staging:
        (staging / "weights.txt").write_text(content)


def load(path) -> tuple[str, int]:
    directory, info = open_checkpoint(path)
    return (directory / "weights.txt").read_text(), info.global_step


def test_round_trip_records_step_backend_and_world_size(tmp_path) -> None:
    target = tmp_path / "ckpt"
    save(target, "v1", step=7)
    directory, info = open_checkpoint(target)
    assert directory == target and info == CheckpointInfo(global_step=7, backend="test", world_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left behind
    save(target, "v2", step=8)
    assert load(target) == ("v2", 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_while_ranks_write_keeps_the_previous_checkpoint(tmp_path) -> None:
    target = tmp_path / "ckpt"
    save(target, "v1", step=1)
    with pytest.raises(Crash):
        with atomic_checkpoint(target, global_step=2, backend="test") as staging:
            (staging / "weights.txt").write_text("half-writ")
            raise Crash
    assert load(target) == ("v1", 1)
    # The interrupted staging directory is never trusted, and the next save replaces it.
    staging = tmp_path / ".ckpt.saving"
    with pytest.raises(
        CheckpointError,
        match=rf"incomplete checkpoint at {re.escape(str(staging))}.*resume from an earlier one",
    ):
        open_checkpoint(staging)
    save(target, "v3", step=3)
    assert load(target) == ("v3", 3)


@pytest.mark.parametrize("failing_call", [1, 2])
def test_crash_between_renames_leaves_old_or_new(tmp_path, monkeypatch, failing_call: int) -> None:
    """Rename 1 moves the old checkpoint aside, rename 2 moves the new one into place."""
    target = tmp_path / "ckpt"
    save(target, "v1", step=1)
    real_rename, calls = os.rename, []

    def crashing_rename(source, destination):
        calls.append(source)
        if len(calls) == failing_call:
            raise Crash
        real_rename(source, destination)

    monkeypatch.setattr(checkpoint.os, "rename", crashing_rename)
    with pytest.raises(Crash):
        save(target, "v2", step=2)
    monkeypatch.setattr(checkpoint.os, "rename", real_rename)
    # Before the first rename the old one is in place; between them the new one is found.
    assert load(target) == (("v1", 1) if failing_call == 1 else ("v2", 2))
    save(target, "v3", step=3)
    assert load(target) == ("v3", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_writing_the_marker_of_a_first_save_leaves_nothing_to_load(tmp_path, monkeypatch) -> None:
    def crash(*_args):
        raise Crash

    monkeypatch.setattr(checkpoint, "_write_marker", crash)
    with pytest.raises(Crash):
        save(tmp_path / "ckpt", "v1", step=1)
    with pytest.raises(CheckpointError, match=rf"no checkpoint at {re.escape(str(tmp_path / 'ckpt'))}"):
        open_checkpoint(tmp_path / "ckpt")


def test_directory_without_marker_is_refused_by_load_and_save(tmp_path) -> None:
    foreign = tmp_path / "ckpt"
    foreign.mkdir()
    (foreign / "model.pt").write_text("?")
    with pytest.raises(
        CheckpointError,
        match=rf"incomplete checkpoint at {re.escape(str(foreign))}: it has no {MARKER_FILE}.*a save was interrupted",
    ):
        open_checkpoint(foreign)
    with pytest.raises(
        CheckpointError,
        match=rf"{re.escape(str(foreign))} exists and is not a verl-core checkpoint.*refusing",
    ):
        save(foreign, "v1", step=1)
    assert (foreign / "model.pt").read_text() == "?"


def test_unreadable_marker_is_an_incomplete_checkpoint(tmp_path) -> None:
    save(tmp_path / "ckpt", "v1", step=1)
    (tmp_path / "ckpt" / MARKER_FILE).write_text("{not json")
    with pytest.raises(
        CheckpointError, match=rf"incomplete checkpoint at {re.escape(str(tmp_path / 'ckpt'))}: cannot read"
    ):
        open_checkpoint(tmp_path / "ckpt")
