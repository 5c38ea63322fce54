"""The trainer's checkpoints: ``checkpoint_dir/global_step_N/``, published atomically, resumed exactly.

A checkpoint holds the actor's engine checkpoint (``actor/``), the critic's (``critic/``) and the
trainer's state (``trainer_state.json``: the step, the data sampler's position, the KL controller).
The whole folder is written into a staging directory and renamed into place with its completion
marker (``verl_core.engine.atomic_checkpoint``), so a crash mid-save never becomes the resume point:
``resume_mode: auto`` continues from the newest *complete* ``global_step_N``, every piece of it checked
first (``checkpoint_problems``). A save that fills the disk is one error naming the folder and the
room a checkpoint takes, its unfinished folder removed. Only the newest ``max_checkpoints`` are kept.
The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_core.config.convert import unstructure
from verl_core.config.run import RunConfig, TrainerConfig
from verl_core.errors import CheckpointError
from verl_core.toolkit.checkpoint import MARKER_FILE, atomic_checkpoint, open_checkpoint, read_checkpoint_info
from verl_core.toolkit.integrity import damaged_files
from verl_core.trainer import console

#: The name of step N's checkpoint folder in ``trainer.checkpoint_dir``.
STEP_DIR = "global_step_{step}"
STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
#: The key of ``TRAINER_STATE`` that records the run's optimiser settings (``optim_settings``).
OPTIM_SETTINGS = "optim_settings"
ACTOR_DIR, CRITIC_DIR = "actor", "critic"
#: The ``backend`` its marker records: a trainer checkpoint, not one engine's.
TRAINER_BACKEND = "trainer"
#: What every trainer checkpoint's ``TRAINER_STATE`` holds, whatever the trainer (``Trainer.save_checkpoint``).
STATE_KEYS = ("trainer", "global_step", "sampler")
#: The OS's errors of a full disk and of an exhausted quota.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: A save that fails with less room than this left on its file system failed of a full disk, whatever
#: it raised: torch's writer reports one as ``unexpected pos 576 vs 534``, without the OS's error.
FULL_DISK_BYTES = 1 << 20


def save(config: RunConfig, step: int, actor: Any, critic: Any, state: dict[str, Any]) -> Path:
    """Write step ``step``'s checkpoint and publish it; drop checkpoints beyond ``max_checkpoints``.

    ``state`` is the trainer's own (JSON-able); the optimiser settings of the run are recorded beside
    it, so that a resume can say which of them it cannot apply (``restore``)."""
    trainer = config.trainer
    path = Path(trainer.checkpoint_dir) / STEP_DIR.format(step=step)
    try:
        with atomic_checkpoint(path, global_step=step, backend=TRAINER_BACKEND) as staging:
            actor.save_checkpoint(str(staging / ACTOR_DIR), step)
            if critic is not None:
                critic.save_checkpoint(str(staging / CRITIC_DIR), step)
            recorded = {**state, OPTIM_SETTINGS: optim_settings(config)}
            (staging / TRAINER_STATE).write_text(json.dumps(recorded, indent=2))
    except BaseException as error:
        if disk_full(error, path.parent):  # a rank's error, or this process's
            raise _disk_full_error(trainer, step, path, error) from error
        raise
    _keep_newest(Path(trainer.checkpoint_dir), trainer.max_checkpoints)
    return path


def disk_full(error: BaseException, folder: Path) -> bool:
    """Whether ``error``, raised while writing into ``folder``, means its disk is full: the OS says so
    somewhere in its causes (a rank's error, ``torch.distributed.checkpoint``'s per-rank failures), or
    an I/O error (``OSError``, torch's ``RuntimeError``) left next to no room there. Never for a stop
    (Ctrl-C, SIGTERM), which is not an ``Exception``."""
    if not isinstance(error, Exception) and not isinstance(getattr(error, "failures", None), dict):
        return False  # a stop; DCP's CheckpointException is a BaseException with its ranks' failures
    causes = list(_causes(error))
    full_texts = [os.strerror(number) for number in DISK_FULL_ERRNOS]
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(cause) for text in full_texts):  # what survives pickling across processes
            return True
    if not any(isinstance(cause, OSError | RuntimeError) for cause in causes):
        return False
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, what it was raised from, and the per-rank failures DCP collects, depth first."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        for failure in failures.values() if isinstance(failures, dict) else ():
            if isinstance(failure, tuple) and failure:  # DCP's (exception, its stack summary)
                failure = failure[0]
            if isinstance(failure, BaseException):
                pending.append(failure)


def _disk_full_error(trainer: TrainerConfig, step: int, path: Path, error: BaseException) -> CheckpointError:
    """The one error of a checkpoint save that filled the disk. Its unfinished folder is removed
    (nothing half-written is trusted, and its room is free again)."""
    folder = Path(trainer.checkpoint_dir)
    staging = path.with_name(f".{path.name}.saving")  # ``atomic_checkpoint``'s
    written = _size(staging)
    shutil.rmtree(staging, ignore_errors=True)
    saved = complete_checkpoints(folder)
    if saved:
        last_step, last = saved[-1]
        needed = f"about {_bytes(_size(last))} (the size of {last.name})"
        resume = f"then run the same command to resume from {last} (step {last_step}), the last complete checkpoint"
    else:
        needed = f"more than the {_bytes(written)} written before the disk filled"
        resume = "then run the same command (no checkpoint was complete yet: it starts over)"
    free = shutil.disk_usage(folder).free if folder.is_dir() else 0
    cause = " ".join(str(error).split())[:200]
    return CheckpointError(
        f"the disk of trainer.checkpoint_dir {folder} is full: saving the checkpoint of step {step} failed "
        f"({type(error).__name__}: {cause}) and was removed. A checkpoint of this run needs {needed}; "
        f"{_bytes(free)} are free there now. Free space on that disk, or set trainer.checkpoint_dir to a "
        f"disk with room (trainer.max_checkpoints=K keeps only the newest K); {resume}"
    )


def _size(directory: Path) -> int:
    """The bytes of the files under ``directory`` (0 if it is gone)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # removed meanwhile
                continue
    return total


def _bytes(count: int) -> str:
    """``966028 bytes (0.9 MiB)``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if count >= size / 10:
            return f"{count} bytes ({count / size:.1f} {unit})"
    return f"{count} bytes"


def optim_settings(config: RunConfig) -> dict[str, Any]:
    """``{"actor.engine.optim.lr": 0.001, ...}``: what the optimiser and schedule state of a checkpoint
    were made with, for the roles that have an optimiser."""
    engines = {"actor.engine": config.actor.engine}
    if config.critic.enable and config.critic.engine is not None:
        engines["critic.engine"] = config.critic.engine
    return {
        f"{path}.optim.{key}": value
        for path, engine in engines.items()
        for key, value in unstructure(engine.optim).items()
    }


def changed_optim_settings(state: dict[str, Any], config: RunConfig) -> list[str]:
    """Each optimiser setting that differs between the checkpoint's ``state`` and ``config``: a resume
    restores the optimiser and its schedule as they were saved, so these changes do not apply."""
    saved = state.get(OPTIM_SETTINGS) or {}
    now = optim_settings(config)
    return [
        f"{key}: {saved[key]!r} in the checkpoint, {now[key]!r} now"
        for key in now
        if key in saved and saved[key] != now[key]
    ]


def complete_checkpoints(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint in ``checkpoint_dir``, oldest first."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = STEP_DIR_PATTERN.match(child.name)
        if match and (child / MARKER_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def trainer_kind(path: str | Path) -> str | None:
    """Which trainer wrote the checkpoint at ``path`` (``rl`` or ``sft``), or None if it cannot tell."""
    try:
        return json.loads((Path(path) / TRAINER_STATE).read_text()).get("trainer")
    except (OSError, ValueError, AttributeError):
        return None


def open_trainer_checkpoint(path: str | Path) -> Path:
    """The complete trainer checkpoint at ``path``; a ``CheckpointError`` naming what it is instead."""
    directory, _ = open_checkpoint(path, backend=TRAINER_BACKEND)
    return directory


def checkpoint_dir_problems(trainer: TrainerConfig, kind: str) -> Iterator[tuple[str, str]]:
    """Why this run must not use ``trainer.checkpoint_dir``: it holds another kind of run's
    checkpoints (an SFT run's for an RL run, say), or an earlier run's while ``resume_mode`` is
    ``disable`` and this run saves (its ``global_step_N`` would sit among them, and a later ``auto`` run
    would resume from whichever is newest)."""
    found = complete_checkpoints(trainer.checkpoint_dir)
    if not found:
        return
    newest = found[-1][1]
    other = trainer_kind(newest)
    if other is not None and other != kind:
        command = "verl-core sft" if other == "sft" else "verl-core train"
        yield (
            "trainer.checkpoint_dir",
            f"{trainer.checkpoint_dir} holds another kind of run's checkpoints ({newest.name}, written by "
            f"`{command}`): give this run its own checkpoint_dir",
        )
    elif trainer.resume_mode == "disable" and trainer.save_freq:
        yield (
            "trainer.checkpoint_dir",
            f"{trainer.checkpoint_dir} holds checkpoints of an earlier run ({newest.name} the newest) and "
            "resume_mode is 'disable': give this run another checkpoint_dir, remove them, or continue from "
            "them (trainer.resume_mode=auto)",
        )


def resume_candidates(trainer: TrainerConfig) -> list[Path]:
    """The checkpoints to try resuming from, in order, as ``resume_mode`` says: every complete one,
    newest first (``auto``: a damaged one is skipped for the next), the given one (``resume_path``), or
    none (``disable``)."""
    if trainer.resume_mode == "disable":
        return []
    if trainer.resume_mode == "resume_path":
        return [open_trainer_checkpoint(trainer.resume_from_path)]
    return [path for _, path in reversed(complete_checkpoints(trainer.checkpoint_dir))]


def checkpoint_problems(path: str | Path) -> list[str]:
    """``"<file> <problem>"`` for each piece of the trainer checkpoint at ``path`` that a resume needs
    and that is missing or damaged: the files ``damaged_files`` finds (cut short, or gone from the list
    its markers keep), and those every trainer checkpoint has whatever its age: the trainer's state with
    its keys, the actor's engine checkpoint with its marker, the critic's when there is one."""
    path = Path(path)
    problems = damaged_files(path)
    state = path / TRAINER_STATE
    if not state.is_file():
        problems.append(f"{state} is missing")
    else:
        try:
            recorded = json.loads(state.read_text())
        except (OSError, ValueError):
            recorded = None  # reported by ``damaged_files``
        if isinstance(recorded, dict):
            problems += [f"{state} has no {key!r}" for key in STATE_KEYS if key not in recorded]
    for role in (ACTOR_DIR, CRITIC_DIR):
        marker = path / role / MARKER_FILE
        if (role == ACTOR_DIR or (path / role).exists()) and not marker.is_file():
            problems.append(f"{marker} is missing (the {role}'s engine checkpoint is incomplete)")
    return list(dict.fromkeys(problems))


def resume_point(trainer: TrainerConfig) -> Path | None:
    """The checkpoint a run resumes from, as ``resume_mode`` says, trusted only once every piece of it
    is checked (``checkpoint_problems``), or None for a fresh run. Under ``auto`` a damaged checkpoint
    is skipped with a warning naming the file, for the next older one; a damaged ``resume_from_path``,
    or a damaged oldest one, is a ``CheckpointError`` naming the file. It reads file headers only, so
    it runs before any worker starts."""
    candidates = resume_candidates(trainer)
    for position, path in enumerate(candidates):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        if trainer.resume_mode == "auto" and position + 1 < len(candidates):
            console.warn(
                f"skipping the damaged checkpoint {path} ({problems[0]}); resuming from {candidates[position + 1].name}"
            )
            continue
        fix = (
            "resume from another checkpoint (trainer.resume_from_path)"
            if trainer.resume_mode == "resume_path"
            else "no older complete checkpoint to fall back to: restore the file"
        )
        raise CheckpointError(
            f"damaged checkpoint at {path}: {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + f"; {fix}, or start a fresh run (trainer.resume_mode=disable with another checkpoint_dir)"
        )
    return None


def engine_problems(config: RunConfig, path: Path) -> list[tuple[str, str]]:
    """``(key, message)`` for each engine of the run that cannot continue the trainer checkpoint at
    ``path``, found from the files before any worker starts: a LoRA adapter of another rank, alpha or
    target modules, or trained over base weights that changed since (``verl_core.toolkit.lora``), and a
    LoRA checkpoint under full training or the reverse. The engines refuse the same when they load."""
    from verl_core.toolkit.lora import LORA_CHECKPOINT_FILE, lora_checkpoint_problems

    sections = {ACTOR_DIR: config.actor.engine}
    if config.critic.enable and config.critic.engine is not None:
        sections[CRITIC_DIR] = config.critic.engine
    problems = []
    for role, engine in sections.items():
        directory, key = path / role, f"{role}.engine.model"
        if engine.model.lora:
            found = lora_checkpoint_problems(directory, engine.model)
            problems += [
                (f"{key}.{engine.model.lora_key}", f"resuming from {path}: {found}") for found in found
            ]
        elif (directory / LORA_CHECKPOINT_FILE).is_file():
            problems.append(
                (
                    f"{key}.lora_rank",
                    f"resuming from {path}: its {role} trained a LoRA adapter ({LORA_CHECKPOINT_FILE}), and this "
                    "run trains the full model: set the LoRA keys as the run that saved it did, or start a new "
                    "run in another trainer.checkpoint_dir",
                )
            )
    return problems


def restore(
    config: RunConfig, kind: str, actor: Any, critic: Any, path: Path | None
) -> tuple[Path, dict[str, Any]] | None:
    """Load the checkpoint at ``path`` (``resume_point``'s choice) into the roles: ``(folder, trainer
    state)``, or None for a fresh run (``path`` None). Optimiser settings changed since the checkpoint
    (they cannot apply: its state is restored) warn."""
    if path is None:
        return None
    state = load(path, actor, critic)
    if state.get("trainer") != kind:
        raise CheckpointError(
            f"{path} was saved by another kind of run ({state.get('trainer', 'unknown')!r}, not {kind!r}): "
            "give this run its own trainer.checkpoint_dir, or start from that run's Hugging Face export"
        )
    changed = changed_optim_settings(state, config)
    if changed:
        console.warn(
            f"resuming from {path}: its optimiser and learning-rate schedule are restored as saved, so "
            f"these changed settings do not apply: {'; '.join(changed)}. To train with them, start a new "
            "run (another trainer.checkpoint_dir) from this run's Hugging Face export"
        )
    return path, state


def load(path: Path, actor: Any, critic: Any) -> dict[str, Any]:
    """Restore the roles from the checkpoint at ``path``; the trainer's state."""
    info = read_checkpoint_info(path)
    if info.backend != TRAINER_BACKEND:
        raise CheckpointError(f"{path} is an engine checkpoint ({info.backend}), not a trainer checkpoint")
    actor.load_checkpoint(str(path / ACTOR_DIR))
    if critic is not None:
        if not (path / CRITIC_DIR).is_dir():
            raise CheckpointError(
                f"{path} has no critic checkpoint, but this run trains a critic (critic.enable=true): resume "
                "with the configuration that saved it, or start a new run in another checkpoint_dir"
            )
        critic.load_checkpoint(str(path / CRITIC_DIR))
    try:
        return json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"damaged checkpoint at {path}: {TRAINER_STATE} cannot be read ({error})"
        ) from error


def _keep_newest(checkpoint_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for _, old in complete_checkpoints(checkpoint_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
