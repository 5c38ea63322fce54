"""Atomic checkpoint directories, shared by every backend.

A save writes into a hidden sibling ``.<name>.saving``; once every rank has written its files,
rank 0 adds a completion marker (global step, backend, world size, the list of files) and renames
the directory into place. A directory without the marker is never trusted. Saving over an existing
checkpoint moves the old one aside to ``.<name>.replaced`` first and deletes it only after the new
one is in place, so a crash at any point leaves a complete checkpoint: the old one or the new one.

``open_checkpoint`` finds it again even when the crash fell between the two renames.
The directory must be on a file system every rank sees (as for any multi-rank checkpoint).
``reading_checkpoint`` wraps a backend's loading code so that a damaged checkpoint (files missing or
truncated after the marker was written, say by a partial copy) or one of another model is reported
naming the checkpoint, not as a raw ``FileNotFoundError`` or size mismatch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from verl_core.distributed import barrier, group_rank, group_size
from verl_core.errors import CheckpointError

MARKER_FILE = "verl_checkpoint.json"
FORMAT_VERSION = 1
#: The marker's list of every file the checkpoint holds (paths relative to its folder): a file deleted
#: after the save is then found missing before a resume trusts the checkpoint (``integrity``).
MARKER_FILES_KEY = "files"


@attrs.frozen
class CheckpointInfo:
    """What the completion marker of a checkpoint records."""

    global_step: int
    backend: str
    world_size: int


@contextlib.contextmanager
def atomic_checkpoint(
    path: str | os.PathLike, *, global_step: int, backend: str, group: dist.ProcessGroup | None = None
) -> Iterator[Path]:
    """Yield the staging directory every rank writes its files into; publish ``path`` on exit.

    A collective over ``group``: every rank enters and leaves together. If the block raises, nothing
    is published (``path`` keeps its previous content) and the exception propagates.
    """
    final = Path(path)
    staging, replaced = _siblings(final)
    if final.exists() and not (final / MARKER_FILE).is_file() and any(final.iterdir()):
        raise CheckpointError(
            f"{final} exists and is not a verl-core checkpoint (no {MARKER_FILE}): refusing to replace it; "
            "save to another path or remove it"
        )
    rank, world_size = group_rank(group), group_size(group)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left over by an earlier crashed save
        staging.mkdir(parents=True)
    barrier(group)
    yield staging
    barrier(group)  # every rank has written its files
    if rank == 0:
        _write_marker(staging, CheckpointInfo(global_step, backend, world_size))
        _publish(staging, final, replaced)
    barrier(group)  # ``path`` is in place before any rank returns


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, replaceable: str) -> Iterator[Path]:
    """One writer's atomic output directory (a Hugging Face export, say): yield a staging directory,
    then rename it into place. ``path`` appears complete or not at all, and a previous ``path`` is
    replaced only once the new one is written, and only if it holds the file ``replaceable`` (so
    that an unrelated directory is never swept away). If the block raises, nothing is published.
    Its files get the mode the umask gives new files, whatever mode their writer chose.
    """
    final = Path(path)
    staging, replaced = _siblings(final)
    if final.exists() and any(final.iterdir()) and not (final / replaceable).is_file():
        raise CheckpointError(
            f"{final} exists and holds no {replaceable}, so it is not an earlier output of this kind: "
            "refusing to replace it; write to another path or remove it"
        )
    shutil.rmtree(staging, ignore_errors=True)  # left over by an earlier crashed write
    staging.mkdir(parents=True)
    try:
        yield staging
        _umask_modes(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, final, replaced)


def open_checkpoint(path: str | os.PathLike, backend: str | None = None) -> tuple[Path, CheckpointInfo]:
    """The directory to load ``path`` from, and its marker; refuses anything incomplete and, when
    ``backend`` is given, checkpoints written by another engine backend.

    Returns ``path`` itself, or, when a save crashed between moving the old checkpoint aside and
    renaming the new one into place, whichever of the two is complete (the new one first).
    """
    final = Path(path)
    if final.is_file():
        raise CheckpointError(
            f"{final} is a file, not a checkpoint directory: give the folder save_checkpoint wrote "
            f"(the one holding {MARKER_FILE})"
        )
    staging, replaced = _siblings(final)
    candidates = [final] if final.exists() else [staging, replaced]
    for directory in candidates:
        if (directory / MARKER_FILE).is_file():
            info = read_checkpoint_info(directory)
            if backend is not None and info.backend != backend:
                raise CheckpointError(
                    f"{directory} was saved by engine backend '{info.backend}', but this is the "
                    f"'{backend}' backend, which cannot read it: resume with engine.backend={info.backend}, "
                    "or start from a Hugging Face export (save_hf_model)"
                )
            return directory, info
    if final.exists():
        raise CheckpointError(
            f"incomplete checkpoint at {final}: it has no {MARKER_FILE}, so a save was interrupted "
            "(or this is not a verl-core checkpoint); resume from an earlier one"
        )
    if staging.exists():
        raise CheckpointError(
            f"no checkpoint at {final}: only {staging.name}, the folder of a save that was interrupted "
            "before it completed, is there (nothing in it is trusted); resume from an earlier checkpoint"
        )
    raise CheckpointError(f"no checkpoint at {final}: the directory does not exist")


@contextlib.contextmanager
def reading_checkpoint(directory: str | os.PathLike, model: str | None = None) -> Iterator[None]:
    """Report what loading from the checkpoint ``directory`` raises as a ``CheckpointError`` naming it.

    A missing or truncated file in a checkpoint marked complete means it was damaged after the save
    (a partial copy, a full disk); a size mismatch or missing keys mean it belongs to another model
    (``model`` names the one loading it, e.g. its config path). The original error is chained.
    """
    try:
        yield
    except (CheckpointError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:  # torch's distributed CheckpointException derives from BaseException
        raise _classify(directory, model, error) from error


def _classify(directory: str | os.PathLike, model: str | None, error: BaseException) -> CheckpointError:
    if isinstance(error, FileNotFoundError):
        return CheckpointError(
            f"damaged checkpoint at {directory}: {error.filename or error} is missing although the checkpoint "
            "is marked complete (copied partially, or files deleted); resume from another checkpoint"
        )
    text = " ".join(str(error).split())
    if any(sign in text.lower() for sign in ("size mismatch", "missing key", "unexpected key", "shape")):
        return CheckpointError(
            f"the checkpoint at {directory} is of another model than {model or 'this engine'}: {text[:400]}; "
            "resume with the model it was saved from, or start a new run"
        )
    return _unreadable(directory, error)


def load_model_state(
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    directory: str | os.PathLike,
    model: str,
    only: Collection[str] | None = None,
) -> None:
    """``module.load_state_dict(state_dict)`` (strict); a checkpoint of another model (missing keys,
    size mismatches) is an error naming the checkpoint ``directory`` and the ``model`` loading it.

    ``only``: the entries a partial checkpoint holds (a LoRA adapter's, ``HFEngine.checkpointed_state``);
    exactly these must be there, the others keep their values.
    """
    with reading_checkpoint(directory, model):
        if only is None:
            module.load_state_dict(state_dict)
            return
        missing, unexpected = sorted(set(only) - set(state_dict)), sorted(set(state_dict) - set(only))
        if missing or unexpected:
            raise RuntimeError(f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        module.load_state_dict(state_dict, strict=False)


def _unreadable(directory: str | os.PathLike, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"damaged checkpoint at {directory}: a file cannot be read ({type(error).__name__}: "
        f"{' '.join(str(error).split())[:300]}), e.g. truncated by a partial copy or a full disk; resume "
        "from another checkpoint"
    )


def load_checkpoint_file(directory: str | os.PathLike, name: str) -> Any:
    """``torch.load`` of one file of a checkpoint (``weights_only``, onto the CPU), errors named."""
    with reading_checkpoint(directory):
        return torch.load(Path(directory) / name, map_location="cpu", weights_only=True)


def read_checkpoint_info(directory: str | os.PathLike) -> CheckpointInfo:
    """Read the completion marker of a checkpoint directory."""
    marker = Path(directory) / MARKER_FILE
    try:
        data = json.loads(marker.read_text())
        return CheckpointInfo(int(data["global_step"]), str(data["backend"]), int(data["world_size"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"incomplete checkpoint at {directory}: cannot read {MARKER_FILE} ({error}); a save was "
            "interrupted; resume from an earlier one"
        ) from error


def _siblings(final: Path) -> tuple[Path, Path]:
    """The staging directory of a save to ``final`` and where the previous checkpoint waits."""
    return final.with_name(f".{final.name}.saving"), final.with_name(f".{final.name}.replaced")


def _umask_modes(directory: Path) -> None:
    """Give every file under ``directory`` the mode a file created here gets from the umask: some
    writers (safetensors) create theirs 0600, so that an export would be unreadable to the group and
    others who can read the rest of it."""
    probe = directory / ".verl-core-mode"
    probe.touch()  # created as ``open`` creates files: 0666 less the umask, or as a default ACL says
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


def _write_marker(directory: Path, info: CheckpointInfo) -> None:
    files = sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())
    payload = {
        **attrs.asdict(info),
        "format_version": FORMAT_VERSION,
        "saved_at": time.time(),
        MARKER_FILES_KEY: files,
    }
    temporary = directory / f"{MARKER_FILE}.tmp"
    with open(temporary, "w") as handle:
        json.dump(payload, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, directory / MARKER_FILE)


def _publish(staging: Path, final: Path, replaced: Path) -> None:
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)  # stale: ``final`` is newer
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_directory(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
