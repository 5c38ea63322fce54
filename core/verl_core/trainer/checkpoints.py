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
from pathlib import Path
from typing import Any

from verl_core.config.run import TrainerConfig
from verl_core.engine.checkpoint import (
    MARKER_FILE,
    CheckpointError,
    atomic_checkpoint,
    open_checkpoint,
    read_checkpoint_info,
)
from verl_core.errors import ConfigError

#: The name of step N's checkpoint folder in ``trainer.checkpoint_dir``.
STEP_DIR = "global_step_{step}"
STEP_DIR_PATTERN = re.compile(r"^global_step_(\d+)$")
TRAINER_STATE = "trainer_state.json"
ACTOR_DIR, CRITIC_DIR = "actor", "critic"
#: The ``backend`` its marker records: a trainer checkpoint, not one engine's.
TRAINER_BACKEND = "trainer"


def save(trainer: TrainerConfig, step: int, actor: Any, critic: Any, state: dict[str, Any]) -> Path:
    """Write step ``step``'s checkpoint and publish it; drop checkpoints beyond ``max_checkpoints``."""
    path = Path(trainer.checkpoint_dir) / STEP_DIR.format(step=step)
    with atomic_checkpoint(path, global_step=step, backend=TRAINER_BACKEND) as staging:
        actor.save_checkpoint(str(staging / ACTOR_DIR), step)
        if critic is not None:
            critic.save_checkpoint(str(staging / CRITIC_DIR), step)
        (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    _keep_newest(Path(trainer.checkpoint_dir), trainer.max_checkpoints)
    return path


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


def find_resume_point(trainer: TrainerConfig) -> Path | None:
    """The checkpoint to resume from, as ``resume_mode`` says: the newest complete one (``auto``), the
    given one (``resume_path``; an error when it is not a complete checkpoint), or none.

    A fresh run (``disable``) that saves checkpoints refuses a ``checkpoint_dir`` holding an earlier
    run's: its ``global_step_N`` would sit among them, and a later ``auto`` run would resume from
    whichever is newest, possibly the earlier run's.
    """
    if trainer.resume_mode == "disable":
        earlier = complete_checkpoints(trainer.checkpoint_dir) if trainer.save_freq else []
        if earlier:
            raise ConfigError(
                [
                    (
                        "trainer.checkpoint_dir",
                        f"{trainer.checkpoint_dir} holds checkpoints of an earlier run ({earlier[-1][1].name} the "
                        "newest) and resume_mode is 'disable': give this run another checkpoint_dir, remove "
                        "them, or continue from them (trainer.resume_mode=auto)",
                    )
                ]
            )
        return None
    if trainer.resume_mode == "resume_path":
        directory, _ = open_checkpoint(trainer.resume_from_path, backend=TRAINER_BACKEND)
        return directory
    found = complete_checkpoints(trainer.checkpoint_dir)
    return found[-1][1] if found else None


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
