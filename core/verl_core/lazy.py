"""Lazy re-exports for packages whose names live in heavy modules (torch, transformers, pytest).

``__getattr__, __dir__ = lazy_exports(__name__, {"Name": "package.module", ...})`` in a package's
``__init__`` makes ``from package import Name`` work while importing the package itself stays cheap.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], moved: Callable[[str], Any] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` that import ``exports[name]`` on first use; other
    names go to ``moved`` (``verl_core.deprecation.moved_names``: the names that left, with a warning)."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        if moved is not None:
            return moved(name, stacklevel=3)  # the warning points past this function
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__


def exports_win_over_submodules(package: str, names: set[str]) -> None:
    """Keep ``package.<name>`` the exported object for each of ``names`` that is also a submodule's name
    (``verl_core.testing.spawn``, the function, lives in ``verl_core.testing.spawn``, the module).

    Importing a submodule binds it as an attribute of its package, which would shadow the lazily
    exported object of the same name from then on: ``from verl_core.testing import spawn`` would give
    the module or the function depending on what ran before. ``import package.name`` still works.
    """

    class Package(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in names and isinstance(value, types.ModuleType):
                return  # the import system binding the submodule: keep the export
            super().__setattr__(name, value)

    sys.modules[package].__class__ = Package
