"""Make "a rank returned before another rank finished writing" fail every time, not when timing allows.

``save_hf_model`` and ``save_checkpoint`` are collectives: no rank may return before what they write is
in place. An engine that forgets the final barrier is caught only if a rank that does not write
happens to look before the writing rank is done, which on a fast machine it often does not. Inside
``publication_held``, the first write a rank makes *into* the target (a file or folder inside it, or a
rename onto it: the moment the output appears) waits until every other rank has called ``returned()``
or ``HOLD_S`` has passed. A rank that returned too early thus always looks before the output exists,
while a correct engine's other ranks sit in its barrier, and the writer goes on after ``HOLD_S``: the
price of the check is one hold per save at two or more ranks.

Writes are seen where Python makes them (``open`` for writing, ``os.mkdir``, ``os.rename``,
``os.replace``); a file written by native code inside the target (safetensors) is covered by the Python
writes before or after it, and an atomic publisher (write aside, rename onto the target) by its rename.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

#: How long a writing rank's first write into the target waits for the other ranks at most.
HOLD_S = 1.0

_uses = itertools.count()


@contextlib.contextmanager
def publication_held(
    target: str | os.PathLike, store: Any, rank: int, world_size: int, hold_s: float = HOLD_S
) -> Iterator[Callable[[], None]]:
    """Hold this rank's first write into ``target`` (see the module docstring); yields ``returned``, to
    call once this rank's save returned and it has looked at ``target``. Every rank must enter it, the
    same number of times (each use has its own store keys). Without a ``store`` nothing is held."""
    if store is None or world_size == 1:
        yield lambda: None
        return
    key = f"publication_held/{next(_uses)}"
    others = [f"{key}/{other}" for other in range(world_size) if other != rank]
    inside = os.path.abspath(target)
    held = threading.Event()

    def into_target(path: Any) -> bool:
        if isinstance(path, int):  # a file descriptor
            return False
        path = os.path.abspath(os.fsdecode(path))
        return path == inside or path.startswith(inside + os.sep)

    def hold(path: Any) -> None:
        if not held.is_set() and into_target(path):
            held.set()
            with contextlib.suppress(Exception):  # the others did not all return in time: a correct engine
                store.wait(others, timedelta(seconds=hold_s))

    def writing(mode: str) -> bool:
        return any(flag in mode for flag in "wax+")

    original_open, original_io_open = builtins.open, io.open
    originals = {name: getattr(os, name) for name in ("mkdir", "rename", "replace")}

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if writing(mode):
            hold(file)
        return original_open(file, mode, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        hold(path)
        originals["mkdir"](path, *args, **kwargs)

    def moving(name: str) -> Callable[..., None]:
        def move(source: Any, destination: Any, *args: Any, **kwargs: Any) -> None:
            hold(destination)
            originals[name](source, destination, *args, **kwargs)

        return move

    builtins.open = io.open = open_
    os.mkdir, os.rename, os.replace = mkdir, moving("rename"), moving("replace")
    try:
        yield lambda: store.set(f"{key}/{rank}", "returned")
    finally:
        builtins.open, io.open = original_open, original_io_open
        for name, function in originals.items():
            setattr(os, name, function)
