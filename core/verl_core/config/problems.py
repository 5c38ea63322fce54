"""What structuring a config raised, as ``(full.dotted.path, message)`` pairs: the path of each error
from the notes cattrs leaves on its way up, and the wording of unknown, missing and mistyped values."""

from __future__ import annotations

from typing import Any

import attrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from verl_core.errors import ConfigError, did_you_mean

Errors = list[tuple[str, str]]

MISSING_KEY = "required key is missing: set it in the YAML file or with an override"


def unknown_key_message(key: str, allowed: list[str]) -> str:
    """``unknown key (did you mean 'lr'?)``, or the allowed keys when none is close."""
    hint = did_you_mean(key, allowed) or f" (allowed keys: {', '.join(allowed)})"
    return f"unknown key{hint}"


def join_path(prefix: str, step: str) -> str:
    """``actor`` + ``engine`` -> ``actor.engine``; ``data.train_files`` + ``[1]`` -> ``data.train_files[1]``."""
    if not step:
        return prefix
    if not prefix:
        return step
    return prefix + step if step.startswith("[") else f"{prefix}.{step}"


def _step_of(exc: BaseException) -> str | None:
    """The field name or ``[index]`` / key that cattrs noted on ``exc`` while collecting it."""
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            return note.name
        if isinstance(note, IterableValidationNote):
            return f"[{note.index}]" if isinstance(note.index, int) else str(note.index)
    return None


def errors_of(exc: BaseException, path: str) -> Errors:
    """Flatten what structuring raised into ``(full.path, message)`` pairs, in field order."""
    if isinstance(exc, ConfigError):
        return [(join_path(path, sub_path), message) for sub_path, message in exc.errors]
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = [field.name for field in attrs.fields(exc.cl) if field.init]
        return [
            (join_path(path, key), unknown_key_message(key, allowed))
            for key in sorted(map(str, exc.extra_fields))
        ]
    if isinstance(exc, BaseValidationError):
        errors: Errors = []
        for sub in exc.exceptions:
            step = _step_of(sub)
            sub_path = join_path(path, step) if step is not None else path
            if isinstance(sub, KeyError) and step is not None and sub.args == (step,):
                errors.append((sub_path, MISSING_KEY))
            else:
                errors += errors_of(sub, sub_path)
        return errors
    if isinstance(exc, (TypeError, ValueError)):
        return [(path, str(exc))]
    return [(path, f"{type(exc).__name__}: {exc}")]


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def mismatch(expected: str, value: Any) -> TypeError:
    hint = ""
    if expected == "str" and isinstance(value, (int, float)):
        hint = " (quote it to make it a string)"
    elif expected == "a list" and isinstance(value, str):
        hint = f" (a list of one: [{value}])"
    return TypeError(f"expected {expected}, got {short_repr(value)}{hint}")
