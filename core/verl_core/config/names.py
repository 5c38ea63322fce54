"""Names in a config that select what plugins provide, resolved while the config loads.

A field declared with ``registered(kind, default)`` holds the name of a descriptor of a registry kind
(``verl_core.hookspecs``: advantage estimators, policy losses, reward functions, ...). ``structure``
looks each one up in the registry and reports an unknown, conflicting or broken name at the field's
full path, as one line with what the registry says (the installed names, the close match, the
fix), before anything runs. Nothing is imported: the registry checks its descriptors without
importing them, and a function in a user's file (``path/to/file.py:function``, where a field
allows it) is found by parsing the file.
"""

from __future__ import annotations

import ast
import contextvars
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

import attrs

from verl_core.descriptors import is_file_spec
from verl_core.errors import VerlCoreError, did_you_mean

if TYPE_CHECKING:
    from verl_core.plugins import Registry

#: Key of ``Registered`` in an ``attrs.field``'s metadata.
METADATA_KEY = "verl_core.registered"
#: How a user file's function is written, in messages.
FILE_SPEC_FORM = "path/to/file.py:function_name"
#: The registry that names are looked up in, for the ``structure`` call in progress (None: the
#: process-wide one).
lookup_registry: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("registry", default=None)


def current_registry() -> Registry:
    """The registry of the ``structure`` call in progress, or the process-wide one."""
    from verl_core.plugins.registry import registry_or_installed  # discovery only when a name is looked up

    return registry_or_installed(lookup_registry.get())


@attrs.frozen
class Registered:
    """Field metadata: the field names a descriptor of registry ``kind``.

    ``files``: a user's file ``path/to/file.py:function_name`` is accepted too (``is_file_spec``).
    """

    kind: str
    files: bool = False


def registered(kind: str, default: str, *, files: bool = False) -> Any:
    """An ``attrs.field`` naming a descriptor of registry ``kind``, checked by ``structure``.

    A config built in Python is not looked up (that needs the registry); the consumer's own lookup
    (``Registry.get``) reports a bad name then.
    """
    return attrs.field(default=default, metadata={METADATA_KEY: Registered(kind, files)})


def registered_list(kind: str, default: list[str]) -> Any:
    """Like ``registered``, for a field holding a list of names, each looked up (``trainer.logger``)."""
    return attrs.field(factory=lambda: list(default), metadata={METADATA_KEY: Registered(kind)})


def one_line(error: BaseException) -> str:
    """A registry error as one line of a config error: its lines joined, nothing dropped."""
    return " ".join(str(error).splitlines())


def name_problem(registry: Registry, spec: Registered, value: str) -> str | None:
    """Why ``value`` does not resolve as ``spec`` says, in one line; ``None`` when it does."""
    if spec.files and is_file_spec(value):
        return file_function_problem(value)
    if spec.files and value.endswith(".py"):
        return f"names a file but no function in it: write '{value}:function_name'"
    try:
        registry.get(spec.kind, value)
    except VerlCoreError as error:
        message = one_line(error)
        if spec.files:
            message += f" Or name a function in your own file: {FILE_SPEC_FORM}."
        return message
    return None


# -- functions in user files ------------------------------------------------------------------------


def top_level_names(tree: ast.Module) -> tuple[list[str], list[str]]:
    """``(functions, every name)`` bound at the top level of a module, in source order.

    Names bound inside top-level ``if``, ``try`` and ``with`` blocks count (a fallback definition);
    names inside functions and classes do not.
    """
    functions: list[str] = []
    bound: list[str] = []
    statements = list(tree.body)
    while statements:
        node = statements.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(node.name)
            bound.append(node.name)
        elif isinstance(node, ast.ClassDef):
            bound.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound += [
                name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)
            ]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound += [(alias.asname or alias.name).partition(".")[0] for alias in node.names]
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            handlers = [handler.body for handler in getattr(node, "handlers", [])]
            blocks = [node.body, getattr(node, "orelse", []), *handlers, getattr(node, "finalbody", [])]
            statements[:0] = [statement for block in blocks for statement in block]
    return functions, bound


def _read_user_file(path: str, form: str) -> ast.Module | str:
    """The syntax tree of the user's Python file ``path`` (``~`` expanded, relative to the working
    directory), or why it cannot be read, saying to write ``form``."""
    file = os.path.expanduser(path)
    where = (
        file if os.path.isabs(file) else f"{path} (relative to the current working directory, {os.getcwd()})"
    )
    if not os.path.exists(file):
        return f"no such file: {where}; write {form}"
    if not os.path.isfile(file):
        return f"not a file: {where}; write {form}"
    try:
        with open(file, "rb") as stream:
            return ast.parse(stream.read(), filename=file)
    except OSError as error:
        return f"cannot read {where}: {error.strerror or error}"
    except (SyntaxError, ValueError) as error:  # ValueError: null bytes in the source
        line = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
        return f"{file} is not valid Python{line}: {getattr(error, 'msg', None) or error}"


def file_function_problem(spec: str) -> str | None:
    """Why ``path/to/file.py:function`` names no function, found without importing the file.

    The file must exist and parse, and bind ``function`` at its top level (a ``def``, an assignment
    or an import). A relative path is relative to the current working directory and ``~`` is the
    home directory, as when the run imports it (``verl_core.reward.load_reward_function``).
    """
    path, _, name = spec.rpartition(":")
    if not name.isidentifier():
        return f"{name!r} after the last ':' is not a function name: write {FILE_SPEC_FORM}"
    tree = _read_user_file(path, FILE_SPEC_FORM)
    if isinstance(tree, str):
        return tree
    functions, bound = top_level_names(tree)
    if name in bound:
        return None
    suggestion = did_you_mean(name, bound)
    defined = ", ".join(functions) if functions else "none"
    return (
        f"{os.path.expanduser(path)} defines no top-level function or assignment {name!r}{suggestion}; "
        f"its functions: {defined}"
    )


def functions_file_problem(path: str) -> str | None:
    """Why ``path`` is not a ``.py`` file defining a public top-level function (a tools file), found
    without importing it."""
    if not path.endswith(".py"):
        return f"{path!r} is not a .py file: name a Python file whose functions are the tools"
    tree = _read_user_file(path, "path/to/tools.py")
    if isinstance(tree, str):
        return tree
    functions, _ = top_level_names(tree)
    if not any(not name.startswith("_") for name in functions):
        return f"{path} defines no public top-level function: define the tools in it"
    return missing_import_problem(path, tree)


def missing_import_problem(path: str, tree: ast.Module) -> str | None:
    """A module the file imports unconditionally at its top level (not in a ``try``: an optional
    dependency) that is not installed, or a relative import (the file is no package's module), found
    without importing the file or the module (its package is looked for as ``import`` would, on this
    process's ``sys.path``)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            return (
                f"{os.path.expanduser(path)} has a relative import at line {node.lineno}, but the file is "
                "imported on its own, in no package: import by absolute name (with its folder on PYTHONPATH)"
            )
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            package = name.partition(".")[0]
            try:
                found = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):  # a broken installed package: importing it will tell
                found = True
            if not found:
                return (
                    f"{os.path.expanduser(path)} imports {name!r} at line {node.lineno}, but no module "
                    f"{package!r} is installed for {sys.executable}: install it there (or import it inside a "
                    "try block, if it is optional)"
                )
    return None
