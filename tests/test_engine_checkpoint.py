"""Atomic checkpoint directories: a crash at any point of a save leaves a complete checkpoint."""

from __future__ import annotations

import json
import os
import re

import pytest

from verl_core.errors import CheckpointError
from verl_core.toolkit import CheckpointInfo, atomic_checkpoint, checkpoint, open_checkpoint
from verl_core.toolkit.checkpoint import MARKER_FILE


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


# -- what a checkpoint path can be instead of a checkpoint ----------------------------------------


def test_a_file_given_as_checkpoint_says_so(tmp_path) -> None:
    (tmp_path / "model.pt").write_text("")
    with pytest.raises(CheckpointError, match=r"model\.pt is a file, not a checkpoint directory"):
        open_checkpoint(tmp_path / "model.pt")


def test_only_an_interrupted_save_says_so(tmp_path) -> None:
    target = tmp_path / "ckpt"

    with pytest.raises(Crash), atomic_checkpoint(target, global_step=1, backend="test") as staging:
        (staging / "weights.txt").write_text("half")
        raise Crash
    assert (tmp_path / ".ckpt.saving").is_dir() and not target.exists()
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(target)
    assert "only .ckpt.saving, the folder of a save that was interrupted before it completed" in str(
        caught.value
    )
    assert "resume from an earlier checkpoint" in str(caught.value)


# -- reading a checkpoint back: damage and mismatches name the checkpoint --------------------------


def test_damaged_files_after_the_marker_name_the_checkpoint(tmp_path) -> None:
    import torch

    target = tmp_path / "ckpt"
    with atomic_checkpoint(target, global_step=3, backend="test") as staging:
        torch.save({"w": torch.zeros(4)}, staging / "model.pt")
        torch.save({"w": torch.zeros(4)}, staging / "optimizer.pt")
    directory, _ = open_checkpoint(target)
    assert checkpoint.load_checkpoint_file(directory, "model.pt")["w"].shape == (4,)

    (directory / "model.pt").unlink()
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_checkpoint_file(directory, "model.pt")
    assert f"damaged checkpoint at {directory}" in str(caught.value) and "model.pt is missing" in str(
        caught.value
    )

    data = (directory / "optimizer.pt").read_bytes()
    (directory / "optimizer.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"damaged checkpoint at .*a file cannot be read .*truncated"):
        checkpoint.load_checkpoint_file(directory, "optimizer.pt")


def test_a_checkpoint_of_another_model_names_the_checkpoint_and_the_model(tmp_path) -> None:
    import torch

    small, large = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_model_state(
            large, small.state_dict(), tmp_path / "ckpt", "actor.engine.model /models/big"
        )
    message = str(caught.value)
    assert (
        f"the checkpoint at {tmp_path / 'ckpt'} is of another model than actor.engine.model /models/big"
        in message
    )
    assert "size mismatch for weight" in message
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_the_marker_lists_every_file_and_one_deleted_after_the_save_is_missing(tmp_path) -> None:
    """Without the list a deleted file leaves no trace: only the files that are there can be checked."""
    import torch

    from verl_core.toolkit.integrity import damaged_files

    target = tmp_path / "ckpt"
    with atomic_checkpoint(target, global_step=1, backend="test") as staging:
        torch.save({"w": torch.zeros(4)}, staging / "model.pt")
        (staging / "extra").mkdir()
        (staging / "extra" / "notes.txt").write_text("kept")
    listed = json.loads((target / MARKER_FILE).read_text())["files"]
    assert listed == ["extra/notes.txt", "model.pt"]
    assert damaged_files(target) == []
    (target / "extra" / "notes.txt").unlink()
    assert damaged_files(target) == [f"{target / 'extra' / 'notes.txt'} is missing"]


def test_distributed_checkpoint_shards_without_their_metadata_are_damaged(tmp_path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from verl_core.toolkit.integrity import damaged_files

    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=tmp_path / "model", no_dist=True)  # one writer
    assert damaged_files(tmp_path) == []
    (tmp_path / "model" / ".metadata").unlink()
    assert damaged_files(tmp_path) == [
        f"{tmp_path / 'model' / '.metadata'} is missing (the index of {tmp_path / 'model'}'s shards)"
    ]
