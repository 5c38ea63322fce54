"""Whether the files of a model folder or a checkpoint are whole, read from their headers alone, and
which weights a model folder holds (``model_fingerprint``), read from a sample of their bytes.

A file cut short (a partial copy, a full disk) or deleted after a checkpoint was marked complete is
found here without loading a tensor: a safetensors header that promises more bytes than the file has, a
torch file (a zip archive) whose directory at its end is missing, a JSON file that does not parse, a
``torch.distributed.checkpoint`` shard shorter than its metadata says or without its metadata, a file
the checkpoint's completion marker lists that is gone. The trainer skips a damaged checkpoint on
resume and the pre-flight checks refuse damaged weights with it, before anything loads.
"""

from __future__ import annotations

import hashlib
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


class DamagedFile(ValueError):
    """A file that cannot be what its name says; the message is the problem (``is 12 bytes but ...``)."""


def safetensors_header(path: str | Path) -> dict[str, dict]:
    """The tensors of a safetensors file by name (``dtype``, ``shape``, ``data_offsets``), read from its
    header without loading any; ``DamagedFile`` when the header is not readable or the file is shorter
    than the tensors it promises."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            if header_size > size - 8:
                raise DamagedFile(f"is {size} bytes, shorter than its own header ({header_size} bytes)")
            header = json.loads(file.read(header_size))
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        ends = [entry["data_offsets"][1] for entry in tensors.values()]
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as error:
        if isinstance(error, DamagedFile):
            raise
        raise DamagedFile(f"has no readable safetensors header ({type(error).__name__}: {error})") from None
    needed = 8 + header_size + max(ends, default=0)
    if needed > size:
        raise DamagedFile(f"is {size} bytes but its tensors need {needed}")
    return tensors


def _safetensors_problem(path: Path) -> str | None:
    try:
        safetensors_header(path)
    except DamagedFile as problem:
        return str(problem)
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


#: The files that hold a Hugging Face model's weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
#: How many evenly spaced blocks of each weight file ``model_fingerprint`` reads, and their size.
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES = 64, 4096


def model_fingerprint(path: str) -> str:
    """A hash of the weights in the model folder ``path``, to tell whether two runs used the same ones
    without reading them all: each weight file's name and size and ``FINGERPRINT_BLOCKS`` blocks spread
    over it (a few hundred KiB per file). Other weights of the same shapes (another checkpoint, a
    fine-tune of the model) differ in almost every block; a change confined to a few bytes between the
    blocks would go unseen. The config is left out: re-saving it (another transformers) changes no weight."""
    directory = Path(path).expanduser()
    digest = hashlib.sha256()
    for weights in sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as file:
            for block in range(FINGERPRINT_BLOCKS):
                file.seek(size * block // FINGERPRINT_BLOCKS)
                digest.update(file.read(FINGERPRINT_BLOCK_BYTES))
    return digest.hexdigest()
