"""What plugins return from their hooks: frozen, validated descriptions of what they provide.

Nothing here imports torch or a backend. Heavy objects (engine classes, algorithm functions) are
named by an import string ``"package.module:attribute"`` and imported only when used, so that
listing plugins stays fast.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Literal, Union

import attrs

#: Version of the engine contract (``verl_core.engine.BaseEngine`` and the loss contract).
#: A backend declares the version it targets; core refuses backends that speak another one.
ENGINE_API_VERSION = 1

ModelRole = Literal["lm", "value"]
#: ``lm``: a language-model head producing per-token log-probs (policy, reference);
#: ``value``: a scalar value head per token (critic).
MODEL_ROLES: tuple[str, ...] = ("lm", "value")
DEVICES: tuple[str, ...] = ("cpu", "cuda", "npu", "xpu", "mps")

_NAME = re.compile(r"^[a-z][a-z0-9_\-.]*$")
_IMPORT_STRING = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

Loadable = Union[str, Callable[..., Any], type]


def load_object(target: Loadable) -> Any:
    """Import ``"module:attribute"`` (nested attributes allowed); objects pass through."""
    if not isinstance(target, str):
        return target
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _check_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name}={value!r}: names are lower-case, start with a "
            "letter and use only letters, digits, '_', '-' and '.'"
        )


def _check_loadable(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, str):
        if not _IMPORT_STRING.match(value):
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}={value!r}: expected an import string "
                "'package.module:attribute'"
            )
    elif not callable(value):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name}: expected an import string or a callable, "
            f"got {type(value).__name__}"
        )


def _check_members(allowed: tuple[str, ...]) -> Callable[[Any, attrs.Attribute, Any], None]:
    def check(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
        unknown = [v for v in value if v not in allowed]
        if not value or unknown:
            raise ValueError(
                f"{type(instance).__name__}.{attribute.name}={value!r}: expected a non-empty subset of "
                f"{allowed}"
            )

    return check


def _as_tuple(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@attrs.frozen
class EngineBackend:
    """An engine backend: one way to own a model on a rank (FSDP, Megatron, DDP, ...).

    ``engine`` and ``config`` are import strings (or the objects themselves); they are imported only
    when this backend is selected. ``override=True`` states that this backend deliberately replaces
    another plugin's backend of the same name; without it, two providers of one name are an error.
    """

    name: str = attrs.field(validator=_check_name)
    engine: Loadable = attrs.field(validator=_check_loadable)
    config: Loadable = attrs.field(validator=_check_loadable)
    devices: tuple[str, ...] = attrs.field(
        default=("cpu", "cuda"), converter=_as_tuple, validator=_check_members(DEVICES)
    )
    roles: tuple[str, ...] = attrs.field(
        default=("lm", "value"), converter=_as_tuple, validator=_check_members(MODEL_ROLES)
    )
    api_version: int = ENGINE_API_VERSION
    description: str = ""
    override: bool = False

    def load_engine(self) -> type:
        return load_object(self.engine)

    def load_config(self) -> type:
        return load_object(self.config)


@attrs.frozen
class _Function:
    """A named function provided by a plugin (algorithms, rewards)."""

    name: str = attrs.field(validator=_check_name)
    function: Loadable = attrs.field(validator=_check_loadable)
    description: str = ""
    override: bool = False

    def load(self) -> Callable[..., Any]:
        return load_object(self.function)


@attrs.frozen
class AdvantageEstimator(_Function):
    """An advantage estimator: ``function(batch-like tensors, config) -> (advantages, returns)``.

    The exact signature is documented in docs/algorithms.md.
    """


@attrs.frozen
class PolicyLoss(_Function):
    """A policy loss: ``function(...) -> (per-token loss, metrics)``; see docs/algorithms.md."""


@attrs.frozen
class RewardFunction(_Function):
    """A reward function scoring generated responses; see docs/hooks.md."""


@attrs.frozen
class RolloutBackend:
    """A rollout (generation) backend, such as Hugging Face ``generate`` or vLLM."""

    name: str = attrs.field(validator=_check_name)
    rollout: Loadable = attrs.field(validator=_check_loadable)
    config: Loadable = attrs.field(validator=_check_loadable)
    devices: tuple[str, ...] = attrs.field(
        default=("cpu", "cuda"), converter=_as_tuple, validator=_check_members(DEVICES)
    )
    description: str = ""
    override: bool = False
