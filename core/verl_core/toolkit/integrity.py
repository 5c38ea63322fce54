"""Whether the files of a model folder or a checkpoint are whole, read from their headers alone.

A file cut short (a partial copy, a full disk) or deleted after a checkpoint was marked complete is
found here without loading a tensor: a safetensors header that promises more bytes than the file has, a
torch file (a zip archive) whose directory at its end is missing, a JSON file that does not parse, a
``torch.distributed.checkpoint`` shard shorter than its metadata says or without its metadata, a file
the checkpoint's completion marker lists that is gone. The trainer skips a damaged checkpoint on
resume and the pre-flight checks refuse damaged weights with it, before anything loads.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from verl_core.toolkit.checkpoint import MARKER_FILE, MARKER_FILES_KEY

#: Suffixes of torch's zip-archive files (``torch.save``), checked by their zip directory.
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
#: ``torch.distributed.checkpoint``'s metadata file, and its shards' suffix.
DCP_METADATA, DCP_SUFFIX = ".metadata", ".distcp"


def file_problem(path: str | Path) -> str | None:
    """What is wrong with the file ``path``, judged by its kind (its suffix), or ``None``."""
    path = Path(path)
    if not path.is_file():
        return "is missing"
    if path.suffix == ".safetensors":
        return _safetensors_problem(path)
    if path.suffix in TORCH_SUFFIXES:
        if zipfile.is_zipfile(path):
            return None
        return "is not a whole torch file (its zip directory, at the end of the file, is missing)"
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (OSError, ValueError) as error:
            return f"is not valid JSON ({error})"
    return None


def damaged_files(directory: str | Path) -> list[str]:
    """``"<file> <problem>"`` for every damaged or missing file under ``directory`` (a checkpoint), in
    path order: missing are the files a completion marker in it lists (checkpoints saved before
    markers listed their files are checked by what is there)."""
    directory = Path(directory)
    problems = []
    present = sorted(p for p in directory.rglob("*") if p.is_file())
    for path in present:
        if path.name == MARKER_FILE:
            problems += [f"{listed} is missing" for listed in _listed_files(path) if not listed.is_file()]
        if path.name == DCP_METADATA:
            problems += _dcp_problems(path.parent)
            continue
        if path.suffix == DCP_SUFFIX and not (path.parent / DCP_METADATA).is_file():
            problems.append(f"{path.parent / DCP_METADATA} is missing (the index of {path.parent}'s shards)")
            continue
        problem = file_problem(path)
        if problem:
            problems.append(f"{path} {problem}")
    return list(dict.fromkeys(problems))  # a shard both listed and indexed is named once


def _listed_files(marker: Path) -> list[Path]:
    """The files a checkpoint's completion marker lists (none when it predates the list or is not
    readable, which ``file_problem`` reports)."""
    try:
        listed = json.loads(marker.read_text()).get(MARKER_FILES_KEY) or []
    except (OSError, ValueError, AttributeError):
        return []
    return [marker.parent / name for name in listed if isinstance(name, str)]


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            if header_size > size - 8:
                return f"is {size} bytes, shorter than its own header ({header_size} bytes)"
            header = json.loads(file.read(header_size))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"has no readable safetensors header ({type(error).__name__}: {error})"
    needed = 8 + header_size + max(ends, default=0)
    if needed > size:
        return f"is {size} bytes but its tensors need {needed}"
    return None


def _dcp_problems(directory: Path) -> list[str]:
    """The shards of a ``torch.distributed.checkpoint`` folder that are missing or shorter than its
    metadata says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # a truncated pickle raises whatever unpickling hits
        return [f"{directory / DCP_METADATA} cannot be read ({type(error).__name__}: {error})"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        shard = directory / name
        if not shard.is_file():
            problems.append(f"{shard} is missing")
        elif shard.stat().st_size < size:
            problems.append(f"{shard} is {shard.stat().st_size} bytes but its metadata needs {size}")
    return problems
