"""Exceptions raised by verl-core. Every message names what is wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AgentError",
    "ApiVersionError",
    "CheckpointError",
    "ConfigError",
    "ConfigWarning",
    "DataError",
    "DuplicateNameError",
    "NothingToTrain",
    "PluginError",
    "PluginLoadError",
    "PluginValidationError",
    "PluginWarning",
    "RewardError",
    "RolloutError",
    "SwitchError",
    "TrainerError",
    "UnknownNameError",
    "VerlCoreError",
]


class VerlCoreError(Exception):
    """Base class of all verl-core errors."""


class PluginError(VerlCoreError):
    """A plugin could not be loaded or returned something invalid."""


class PluginLoadError(PluginError):
    """A plugin module raised while being imported."""


class PluginValidationError(PluginError):
    """A plugin implements a hook that does not exist, or a hook returned the wrong type."""


class DuplicateNameError(PluginError):
    """Two plugins provide the same name without an explicit override."""


class ApiVersionError(PluginError):
    """A backend targets an engine API version core does not speak."""


class SwitchError(VerlCoreError, ValueError):
    """An environment switch of plugin discovery (``VERL_CORE_*``) holds a value it cannot have."""


class UnknownNameError(VerlCoreError, LookupError):
    """A backend, estimator, loss, ... name that no installed plugin provides."""


class ConfigError(VerlCoreError, ValueError):
    """A configuration is invalid. ``errors`` holds every problem as ``(dotted.path, message)``."""

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(self.errors)} error(s) in the configuration{where}:"]
        lines += [f"  {path}: {message}" if path else f"  {message}" for path, message in self.errors]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type, tuple[list[tuple[str, str]], str | None]]:
        # Pickled as its problems, not its message: a rank's ConfigError reaches the driver whole.
        return type(self), (self.errors, self.source)


class PluginWarning(UserWarning):
    """Something about the installed plugins that works but is probably not what was meant."""


class ConfigWarning(UserWarning):
    """A configuration value the run will ignore, or one that is probably not what was meant."""


class AgentError(VerlCoreError):
    """A multi-turn rollout cannot run: a chat template that is not append-only, an environment that
    breaks its contract, a tools file that cannot be loaded."""


class CheckpointError(VerlCoreError):
    """A checkpoint directory is missing, incomplete, or was written by an incompatible engine."""


class RolloutError(VerlCoreError):
    """A rollout cannot generate: weights that do not fit its model, or use before initialisation."""


class RewardError(VerlCoreError):
    """A reward function could not be loaded, or failed on a sample (the message names the sample)."""


class DataError(VerlCoreError, ValueError):
    """A dataset file or row cannot be used, or a sampler state does not fit its dataset (the message
    names the file, row or key, and the fix)."""


class TrainerError(VerlCoreError, RuntimeError):
    """A training run cannot go on: the message says why and what to change."""


class NothingToTrain(VerlCoreError):
    """The checkpoint a run would resume from is at its last step already: not a failure, but nothing
    is started (``verl-core train`` prints the message and exits 0). The message says how to go on."""


def close_match(value: object, choices: Iterable[str]) -> str | None:
    """The choice closest to ``value`` (difflib's similarity of 0.6 or more), or ``None``: what every
    message of core suggests for a misspelt name, key or column."""
    if not isinstance(value, str):
        return None
    matches = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'grpo'?)`` for the choice closest to ``value``, or ``""`` when none is close:
    the one wording of the hint, appended to a message."""
    match = close_match(value, choices)
    return f" (did you mean {match!r}?)" if match is not None and match != value else ""
