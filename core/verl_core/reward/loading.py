"""Loading the reward function ``reward.function`` names: a registered name, or a function in a file.

A value is a **file spec** when the part before its last ``:`` ends with ``.py``
(``path/to/rewards.py:my_score``): the file is imported from its path, relative paths relative to
the working directory, under a module name of its own (``verl_core_reward_file_<stem>_<hash of
the path>``, registered in ``sys.modules`` so that dataclasses and pickling work inside it), never
through ``sys.path``: it shadows no installed module and none shadows it. Any other value is a name
looked up in the registry like an algorithm (core's built-ins and every plugin's reward functions;
an unknown name lists the installed ones and the close match). Either way the function must accept
``(prompt, response, extra)``; every failure names the value and the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_core.descriptors import is_file_spec
from verl_core.errors import RewardError, did_you_mean
from verl_core.hookspecs import Kind
from verl_core.plugins.messages import short_repr
from verl_core.plugins.registry import Registry, registry_or_installed

#: The config key whose value ``load_reward_function`` resolves (for messages).
CONFIG_KEY = "reward.function"
#: Prefix of the module names that reward files are imported under.
FILE_MODULE_PREFIX = "verl_core_reward_file_"
#: What every reward function is called with, positionally.
ARGUMENTS: tuple[str, ...] = ("prompt", "response", "extra")

_FORMS = (
    "a registered name ('exact_match'; `verl-core plugins --all` lists them) or a function in your "
    "file, 'path/to/file.py:function_name'"
)


def load_reward_function(spec: str, registry: Registry | None = None) -> Callable[..., Any]:
    """The reward function ``spec`` names: ``path/to/file.py:function_name`` or a registered name.

    ``registry`` defaults to the process-wide one. Raises ``RewardError`` for a file that is missing,
    not a ``.py`` file, raises on import (chained) or has no such function, for an object that is not
    callable or does not accept ``(prompt, response, extra)``; and the registry's errors for names
    (``UnknownNameError`` listing the installed reward functions, ``DuplicateNameError``, ...).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"{CONFIG_KEY}={spec!r}: expected {_FORMS}")
    if is_file_spec(spec):
        path, _, function_name = spec.rpartition(":")
        function, described = _load_from_file(spec, Path(path).expanduser(), function_name)
    else:
        _refuse_malformed(spec)
        entry = registry_or_installed(registry).entry(Kind.REWARD_FUNCTIONS, spec, where=CONFIG_KEY)
        function, described = entry.load("function"), f"reward function '{spec}' from {entry.provider}"
    _check_signature(spec, function, described)
    return function


def _refuse_malformed(spec: str) -> None:
    """A value that is no file spec and cannot be a registered name either (names have no ``:``,
    ``/`` or ``.py`` ending) is refused here, with what it probably meant."""
    path, colon, _ = spec.rpartition(":")
    if spec.endswith(".py"):
        problem = f"names a file but no function in it: write '{spec}:function_name'"
    elif colon:
        problem = (
            f"'{path}' is not a .py file; a function of an installed package is registered by its "
            "plugin (hook verl_reward_functions) and selected by its name"
        )
    elif "/" in spec or "\\" in spec:
        problem = (
            "looks like a path but names no .py file and function: write 'path/to/file.py:function_name'"
        )
    else:
        return
    raise RewardError(f"{CONFIG_KEY}={spec!r} {problem}. Expected {_FORMS}")


def _load_from_file(spec: str, path: Path, function_name: str) -> tuple[Callable[..., Any], str]:
    if not function_name:
        raise RewardError(f"{CONFIG_KEY}={spec!r} names no function after ':': write '{path}:function_name'")
    if not path.is_file():
        shown = path if path.is_absolute() else f"{path} (resolved to {path.absolute()})"
        raise RewardError(
            f"{CONFIG_KEY}={spec!r}: there is no file {shown}; relative paths are relative to the working "
            f"directory, {Path.cwd()}. Fix the path, or make it absolute"
        )
    module = _import_file(spec, path)
    if not hasattr(module, function_name):
        defined = _defined_callables(module)
        raise RewardError(
            f"{CONFIG_KEY}={spec!r}: {path} defines no '{function_name}'{did_you_mean(function_name, defined)}. "
            f"Its functions: {', '.join(defined) or 'none'}."
        )
    function = getattr(module, function_name)
    if not callable(function):
        raise RewardError(
            f"{CONFIG_KEY}={spec!r}: '{function_name}' in {path} is a {type(function).__name__} "
            f"({short_repr(function)}), not a function: name a function "
            "def score(prompt, response, extra) -> float"
        )
    return function, f"'{function_name}' in {path}"


def _import_file(spec: str, path: Path) -> types.ModuleType:
    return import_user_file(path, FILE_MODULE_PREFIX, f"{CONFIG_KEY}={spec!r}", RewardError)


def import_user_file(
    path: Path, module_prefix: str, where: str, error: type[Exception] = RewardError
) -> types.ModuleType:
    """Import the user's file ``path`` as a module of its own name (``module_prefix``, its stem and a
    hash of its resolved path; registered in ``sys.modules``, never found through ``sys.path``); a file
    that raises is reported as ``error`` naming ``where`` (the config key), the cause chained."""
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"{module_prefix}{stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:  # pragma: no cover - a .py file always has one
        raise error(f"{where}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # a sys.exit() at module level is the file's failure too
        del sys.modules[name]
        raise error(f"{where}: {import_problem(path, exc)}. Fix the file") from exc
    return module


def import_problem(path: Path, exc: BaseException) -> str:
    """What importing the user's file ``path`` raised, and at which of its lines: the innermost frame of
    the traceback in the file (a ``SyntaxError``'s own line), for a cause raised from what it imports too."""
    resolved = str(Path(path).resolve())
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == resolved]
    if isinstance(exc, SyntaxError) and exc.filename == resolved:
        lines.append(exc.lineno)
    at = f", at line {lines[-1]} of {Path(path).name}" if lines and lines[-1] else ""
    message = exc.msg if isinstance(exc, SyntaxError) else exc  # its own text names the file and line
    return f"importing {path} raised {type(exc).__name__}: {message}{at}"


def _defined_callables(module: types.ModuleType) -> list[str]:
    """Public functions and classes defined in ``module`` itself (not imported into it)."""
    return sorted(
        name
        for name, value in vars(module).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", None) == module.__name__
    )


def _check_signature(spec: str, function: Callable[..., Any], described: str) -> None:
    """Refuse a function that cannot be called as ``function(prompt, response, extra)``, now rather
    than on the first sample."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins and C callables have none: checked when called
        return
    try:
        signature.bind(*ARGUMENTS)
    except TypeError as exc:
        raise RewardError(
            f"{CONFIG_KEY}={spec!r}: {described} has the signature {signature}, which cannot be called "
            f"as fn(prompt, response, extra) ({exc}). A reward function is "
            "def score(prompt: str, response: str, extra: dict) -> float | dict[str, float]"
        ) from None
