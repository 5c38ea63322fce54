"""One run per folder: a run holds its checkpoint folder and its run folder from start to end, and a
second run on either is refused at start, naming the run that holds it.

The hold is the operating system's lock (``flock``) on the file ``.verl-core.lock`` in the folder,
which belongs to the open file: it ends with the process that took it, however that ends (``kill -9``,
out of memory, a crashed node once a network file system's server notices), so no lock is ever stale.
The file itself is only the holder's note (pid, host, start time, command) for the message: a file
left behind by a dead run holds nothing, and the next run takes it over. Where the file system has no
locks, the run says so and goes on without one.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from verl_core.errors import TrainerError
from verl_core.trainer import console

#: The file in a held folder that the lock is taken on.
LOCK_FILE = ".verl-core.lock"


class FolderInUse(TrainerError):
    """Another live run (or another trainer of this process) holds a folder this run would write to."""


class RunLock:
    """The hold of one run on ``folders`` (``{config key: folder}``), each created if missing;
    ``acquire`` takes them all or none, ``release`` (also at exit) lets them go."""

    def __init__(self, folders: Mapping[str, str | os.PathLike[str]]):
        self.folders: dict[str, Path] = {}
        for key, folder in folders.items():  # a folder named twice (run_dir = checkpoint_dir) is held once
            if Path(folder).resolve() not in {path.resolve() for path in self.folders.values()}:
                self.folders[key] = Path(folder)
        self._files: list[IO[str]] = []

    def acquire(self) -> None:
        """Hold every folder, or raise ``FolderInUse`` naming the folder and the run holding it."""
        try:
            for key, folder in self.folders.items():
                self._hold(key, folder)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let the folders go (closing the file ends the lock); releasing twice is fine."""
        while self._files:
            self._files.pop().close()

    def _hold(self, key: str, folder: Path) -> None:
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        file = open(folder / LOCK_FILE, "a+", encoding="utf-8")  # held until ``release``
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            note = file.read()
            file.close()
            raise FolderInUse(_in_use_message(key, folder, note)) from None
        except OSError as error:  # a file system without locks (some network ones)
            file.close()
            console.warn(
                f"{key} {folder} cannot be locked against a second run ({error.strerror}): make sure no "
                "other run uses it while this one does"
            )
            return
        file.seek(0)
        file.truncate()
        file.write(json.dumps(_note()) + "\n")
        file.flush()
        self._files.append(file)


def _note() -> dict[str, Any]:
    """Who holds the folder: what the message of a refused run shows."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv else "",
    }


def _in_use_message(key: str, folder: Path, note: str) -> str:
    try:
        holder = json.loads(note)
        who = f"pid {holder['pid']} on {holder['host']}, started {holder['started']} (`{holder['command']}`)"
        ours = holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    except (ValueError, KeyError, TypeError):  # the holder has not written its note yet
        who, ours = "a process that has just started (no details written yet)", False
    if ours:
        return (
            f"{key} {folder} is held by another trainer of this process ({who}): call that trainer's "
            "shutdown() (or let its fit() end) first, or give this one another folder"
        )
    return (
        f"{key} {folder} is in use by another run: {who}. Wait for it to end or stop it, or give this run "
        f"another {key}; the hold ends with that process, however it ends"
    )
