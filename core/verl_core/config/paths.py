"""The paths of a run config, made absolute on the driver before the config reaches a worker.

A path in the config is relative to the working directory of the process that reads it. The trainer
reads the datasets, the tokenizer and the reward file in its own process, where the user's relative
paths mean what the user meant; a worker is another process, and on a cluster started with
``ray start`` it runs in the folder where ``ray start`` ran. So the config a worker gets has every
path resolved against the driver's working directory first (``absolute_paths``), while the driver
keeps the config as the user wrote it, and its messages show the paths as the user gave them.

``PATH_KEYS`` lists every key that holds a path; a test holds it to the config classes, so a new
path-typed field must be added here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs

from verl_core.config.run import RunConfig
from verl_core.descriptors import is_file_spec

#: The engines' model folders, and the LoRA adapters they may start from (``{}``: each value of a mapping,
#: the distillation teachers by name).
_MODEL_KEYS = tuple(
    f"{role}.engine.model.{field}"
    for field in ("path", "lora_adapter_path")
    for role in ("actor", "ref", "critic", "distillation.teachers{}")
)
#: Every key of a ``RunConfig`` that holds a file or folder (``[]``: a list of them; ``{}``: in each value
#: of a mapping; ``reward.function`` only when it names a file, ``path/to/file.py:function``).
PATH_KEYS: tuple[str, ...] = (
    *_MODEL_KEYS,
    "data.train_files[]",
    "data.val_files[]",
    "trainer.checkpoint_dir",
    "trainer.run_dir",
    "trainer.resume_from_path",
    "reward.function",
    "rollout.agent.tools",
)
#: The keys whose readers expand ``~`` to the home directory (the model folders, the reward file); the
#: others keep it as a folder name, in the driver and therefore in the workers.
EXPANDS_HOME = frozenset((*_MODEL_KEYS, "reward.function", "rollout.agent.tools"))


def absolute_path(path: str, base: str | os.PathLike[str] | None = None, expand_home: bool = False) -> str:
    """``path`` made absolute against ``base`` (default: the working directory), normalised; with
    ``expand_home``, a leading ``~`` is the home directory first."""
    if expand_home:
        path = os.path.expanduser(path)
    return os.path.normpath(os.path.join(os.fspath(base) if base is not None else os.getcwd(), path))


def absolute_paths(config: RunConfig, base: str | os.PathLike[str] | None = None) -> RunConfig:
    """A copy of ``config`` whose every path (``PATH_KEYS``) is absolute, relative ones resolved
    against ``base`` (default: the working directory); ``config`` itself is unchanged."""
    base = os.fspath(base) if base is not None else os.getcwd()

    def resolve(value: Any, key: str) -> Any:
        home = key in EXPANDS_HOME
        if value is None:
            return None
        if isinstance(value, list):
            return [absolute_path(item, base, home) for item in value]
        if key == "reward.function":
            if not is_file_spec(value):
                return value  # a registered name
            path, _, function = value.rpartition(":")
            return f"{absolute_path(path, base, home)}:{function}"
        return absolute_path(value, base, home)

    for key in PATH_KEYS:
        config = _replace(
            config, key.removesuffix("[]").split("."), lambda value, key=key: resolve(value, key)
        )
    return config


def _replace(obj: Any, steps: list[str], change: Callable[[Any], Any]) -> Any:
    """``obj`` with the attribute at ``steps`` replaced by ``change(value)``; a ``None`` section on
    the way (``ref.engine: null``) is left as it is; a step ``name{}`` goes into each value of a mapping."""
    if obj is None:
        return None
    name, rest = steps[0], steps[1:]
    if name.endswith("{}"):
        name = name.removesuffix("{}")
        mapping = getattr(obj, name)
        return attrs.evolve(
            obj, **{name: {key: _replace(value, rest, change) for key, value in mapping.items()}}
        )
    value = getattr(obj, name)
    return attrs.evolve(obj, **{name: _replace(value, rest, change) if rest else change(value)})
