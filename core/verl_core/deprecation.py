"""Deprecations: a public name, argument or module that changes keeps working, with a warning, for a while.

Public names are a promise (docs/api.md): one that moves, is renamed or loses an argument keeps a
deprecated alias that warns with its replacement until the release ``removed_in`` names, then goes.
Every alias is declared with the helpers here, so that each says the same thing the same way and the
public-API test can list them all (``DEPRECATIONS``)::

    @deprecated(since="0.2.0", removed_in="0.4.0", replacement="verl_core.engine.new_name")
    def old_name(...): ...

    # in a module whose names moved: verl_core.plugins.HOOK_PREFIX -> verl_core.hookspecs.HOOK_PREFIX
    __getattr__ = moved_names(__name__, {"HOOK_PREFIX": "verl_core.hookspecs:HOOK_PREFIX"}, since=..., removed_in=...)

    # the whole file of a module that moved: verl_core/engine/distributed.py
    __getattr__, __dir__, __all__ = moved_module(__name__, "verl_core.distributed", since=..., removed_in=...)

Using a deprecated name emits a ``VerlCoreDeprecationWarning`` (a ``DeprecationWarning``) once per
call site (Python's ``default`` action); the class names the release that removes it, as pytest's
``PytestRemovedIn9Warning`` does: ``VerlCoreRemovedIn04Warning`` for what 0.4.0 removes, so that a
plugin's CI can make exactly what breaks at the next removal an error
(``-W error::verl_core.deprecation.VerlCoreRemovedIn04Warning``). Python hides ``DeprecationWarning``
outside ``__main__``; core shows its own unless you configure warnings yourself (``-W``,
``PYTHONWARNINGS``, pytest's ``filterwarnings``). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs

__all__ = [
    "VerlCoreDeprecationWarning",
    "VerlCoreRemovedIn04Warning",
    "deprecated",
    "deprecated_argument",
    "moved_module",
    "moved_names",
]

T = TypeVar("T")


class VerlCoreDeprecationWarning(DeprecationWarning):
    """A deprecated verl-core name, argument or module was used; the message names its replacement and
    the release that removes it. Each removal release has a subclass (``VerlCoreRemovedIn04Warning``)."""


class VerlCoreRemovedIn04Warning(VerlCoreDeprecationWarning):
    """What verl-core 0.4.0 removes: make it an error to find what a plugin must change before then."""


#: The warning class of each release that removes deprecated names: a core deprecation for a release
#: without one here is refused when declared (add the class, and to ``__all__``).
REMOVAL_WARNINGS: dict[str, type[VerlCoreDeprecationWarning]] = {"0.4.0": VerlCoreRemovedIn04Warning}


@attrs.frozen
class Deprecation:
    """One deprecated name: ``what`` (its dotted path, or a description of an argument), the release
    that deprecated it, the release that removes it, what to use instead, and the warning ``category``
    its uses emit."""

    what: str
    since: str
    removed_in: str
    replacement: str
    category: type[DeprecationWarning] = VerlCoreDeprecationWarning

    @property
    def message(self) -> str:
        return (
            f"{self.what} is deprecated since verl-core {self.since} and will be removed in "
            f"{self.removed_in}: use {self.replacement} instead"
        )


# Python shows DeprecationWarning only for code in __main__; a plugin's use of a deprecated name is in
# its own module, so core shows its own warnings, once per call site, unless the user has configured
# warnings (-W, PYTHONWARNINGS), in which case theirs decide.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=VerlCoreDeprecationWarning)

#: Every deprecation declared so far, by ``what`` (a declaration registers itself when its module is
#: imported; the public-API test imports them all and checks none outlives its ``removed_in``).
DEPRECATIONS: dict[str, Deprecation] = {}


Category = type[DeprecationWarning]


def declare(
    what: str, since: str, removed_in: str, replacement: str, category: Category | None = None
) -> Deprecation:
    """Register a deprecation that is not a name (a behaviour, a missing argument) and return it, for
    ``warn_deprecated``; the helpers below declare theirs themselves. ``category``: the warning class
    (default: verl-core's for ``removed_in``; a plugin deprecating its own names passes its own)."""
    if category is None:
        if removed_in not in REMOVAL_WARNINGS:
            raise ValueError(
                f"{what}: no warning class for removal in {removed_in} (known: {sorted(REMOVAL_WARNINGS)}); "
                "add one to verl_core.deprecation.REMOVAL_WARNINGS, or pass category="
            )
        category = REMOVAL_WARNINGS[removed_in]
    deprecation = Deprecation(what, since, removed_in, replacement, category)
    DEPRECATIONS[what] = deprecation
    return deprecation


def warn_deprecated(deprecation: Deprecation, stacklevel: int = 2) -> None:
    """Emit ``deprecation``'s warning, attributed to the frame ``stacklevel`` levels up (2: the caller of
    the function that calls this)."""
    warnings.warn(deprecation.message, deprecation.category, stacklevel=stacklevel + 1)


def deprecated(
    *, since: str, removed_in: str, replacement: str, category: Category | None = None
) -> Callable[[T], T]:
    """Mark a function or class deprecated: calling (or instantiating) it warns at the caller's line."""

    def decorate(obj: T) -> T:
        what = f"{obj.__module__}.{obj.__qualname__}"
        deprecation = declare(what, since, removed_in, replacement, category)
        if isinstance(obj, type):
            original_init = obj.__init__

            @functools.wraps(original_init)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                warn_deprecated(deprecation)
                original_init(self, *args, **kwargs)

            obj.__init__ = __init__  # type: ignore[misc]
            return obj

        @functools.wraps(obj)  # type: ignore[arg-type]
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            warn_deprecated(deprecation)
            return obj(*args, **kwargs)  # type: ignore[operator]

        return wrapper  # type: ignore[return-value]

    return decorate


def deprecated_argument(
    name: str,
    *,
    since: str,
    removed_in: str,
    replacement: str,
    renamed_to: str | None = None,
    category: Category | None = None,
) -> Callable[[T], T]:
    """Mark keyword argument ``name`` of a function deprecated: passing it warns at the caller's line.

    With ``renamed_to`` the value is passed on under the new name (passing both is a ``TypeError``);
    without it the function must still accept ``name`` itself.
    """

    def decorate(function: T) -> T:
        what = f"argument {name!r} of {function.__module__}.{function.__qualname__}"  # type: ignore[attr-defined]
        deprecation = declare(what, since, removed_in, replacement, category)

        @functools.wraps(function)  # type: ignore[arg-type]
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name in kwargs:
                warn_deprecated(deprecation)
                if renamed_to is not None:
                    if renamed_to in kwargs:
                        raise TypeError(f"pass {renamed_to}= only; {name}= is its deprecated old name")
                    kwargs[renamed_to] = kwargs.pop(name)
            return function(*args, **kwargs)  # type: ignore[operator]

        return wrapper  # type: ignore[return-value]

    return decorate


def _resolve(target: str) -> Any:
    """``"package.module:name"`` or ``"package.module:Class.member"``."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for attribute in qualname.split("."):
        obj = getattr(obj, attribute)
    return obj


def moved_names(
    module: str,
    moved: Mapping[str, str],
    *,
    since: str,
    removed_in: str,
    category: Category | None = None,
) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` that serves each name of ``moved`` (old name ->
    ``"new.module:name"``) from its new home, with a warning at the line that uses it."""
    deprecations = {
        old: declare(f"{module}.{old}", since, removed_in, target.replace(":", "."), category)
        for old, target in moved.items()
    }

    def __getattr__(name: str, stacklevel: int = 2) -> Any:
        # ``stacklevel``: the frame that used the name (2, Python calling this; a wrapper passes more).
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_deprecated(deprecations[name], stacklevel=stacklevel)
        return _resolve(moved[name])

    return __getattr__


def moved_module(
    old: str, new: str, *, since: str, removed_in: str, category: Category | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for the file left at a module's old path: every public name
    of ``new`` stays importable from ``old``, each use warning once per call site."""
    deprecation = declare(old, since, removed_in, new, category)
    names = list(importlib.import_module(new).__all__)

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {new!r})")
        warn_deprecated(deprecation)
        return getattr(sys.modules[new], name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__, names
