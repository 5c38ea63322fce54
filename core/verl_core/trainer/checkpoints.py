"""The trainer's checkpoints: ``checkpoint_dir/global_step_N/``, published atomically, resumed exactly.

A checkpoint holds the actor's engine checkpoint (``actor/``), the critic's (``critic/``) and the
trainer's state (``trainer_state.json``: the step, the data sampler's position, the KL controller).
The whole folder is written into a staging directory and renamed into place with its completion
marker (``verl_core.engine.atomic_checkpoint``), so a crash mid-save never becomes the resume point:
``resume_mode: auto`` continues from the newest *complete* ``global_step_N``. Only the newest
``max_checkpoints`` are kept. The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_core.config.convert import unstructure
from verl_core.config.run import RunConfig, TrainerConfig
from verl_core.errors import CheckpointError, ConfigError
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


def save(config: RunConfig, step: int, actor: Any, critic: Any, state: dict[str, Any]) -> Path:
    """Write step ``step``'s checkpoint and publish it; drop checkpoints beyond ``max_checkpoints``.

    ``state`` is the trainer's own (JSON-able); the optimiser settings of the run are recorded beside
    it, so that a resume can say which of them it cannot apply (``restore``)."""
    trainer = config.trainer
    path = Path(trainer.checkpoint_dir) / STEP_DIR.format(step=step)
    with atomic_checkpoint(path, global_step=step, backend=TRAINER_BACKEND) as staging:
        actor.save_checkpoint(str(staging / ACTOR_DIR), step)
        if critic is not None:
            critic.save_checkpoint(str(staging / CRITIC_DIR), step)
        recorded = {**state, OPTIM_SETTINGS: optim_settings(config)}
        (staging / TRAINER_STATE).write_text(json.dumps(recorded, indent=2))
    _keep_newest(Path(trainer.checkpoint_dir), trainer.max_checkpoints)
    return path


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


def restore(config: RunConfig, kind: str, actor: Any, critic: Any) -> tuple[Path, dict[str, Any]] | None:
    """Load the checkpoint to resume from into the roles: ``(folder, trainer state)``, or None for a
    fresh run. Under ``resume_mode: auto`` a checkpoint with a damaged file (``damaged_files``: cut short
    or missing since it was saved) is skipped with a warning naming the file, for the next older one.
    Optimiser settings changed since the checkpoint (they cannot apply: its state is restored) warn."""
    trainer = config.trainer
    problems = list(checkpoint_dir_problems(trainer, kind))
    if problems:
        raise ConfigError(problems)
    candidates = resume_candidates(trainer)
    for position, path in enumerate(candidates):
        damaged = damaged_files(path)
        if damaged and trainer.resume_mode == "auto" and position + 1 < len(candidates):
            console.warn(
                f"skipping the damaged checkpoint {path} ({damaged[0]}); resuming from {candidates[position + 1].name}"
            )
            continue
        if damaged:
            raise CheckpointError(
                f"damaged checkpoint at {path}: {damaged[0]}"
                + (f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else "")
                + "; no older complete checkpoint to fall back to: restore the file, or start a fresh run "
                "(trainer.resume_mode=disable with another checkpoint_dir)"
            )
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
    return None


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
