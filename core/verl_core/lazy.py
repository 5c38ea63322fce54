"""Lazy re-exports for packages whose names live in heavy modules (torch, transformers, pytest).

``__getattr__, __dir__ = lazy_exports(__name__, {"Name": "package.module", ...})`` in a package's
``__init__`` makes ``from package import Name`` work while importing the package itself stays cheap.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` that import ``exports[name]`` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
