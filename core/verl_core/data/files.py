"""Reading dataset files: the rows of ``.parquet`` files (pyarrow, imported only for them) and JSON Lines
files (``.jsonl``), in order, each row a dict; a row's column, or an error naming the file and the row.

Errors are ``DataError`` s that name the file, the row (rows count from 0, in the order read) or the
config key, and the fix. Nothing here imports torch.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_core.errors import DataError, close_match, did_you_mean

#: File suffixes read as JSON Lines (one JSON object per line, blank lines skipped).
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonlines", ".ndjson")
#: File suffixes read as Parquet (with pyarrow).
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet",)


class Rows(list):
    """The rows ``read_rows`` returns: a ``list`` of dicts that remembers the file each row came from,
    so that datasets can name it in their errors (a plain list works too; its rows are named by index).

    ``files`` holds ``(path, number of rows)`` per file, in order.
    """

    def __init__(self, rows: Iterable[dict[str, Any]] = (), files: Sequence[tuple[str, int]] = ()):
        super().__init__(rows)
        self.files: tuple[tuple[str, int], ...] = tuple(files)
        self._starts: list[int] = []
        start = 0
        for _, count in self.files:
            self._starts.append(start)
            start += count

    def where(self, index: int) -> str:
        """``row 3 of 'data/train.jsonl'``: row ``index`` of the whole list, named in its own file."""
        position = bisect.bisect_right(self._starts, index) - 1
        if position < 0 or not self.files:
            return f"row {index}"
        path, _ = self.files[position]
        return f"row {index - self._starts[position]} of '{path}'"


def read_rows(paths: Sequence[str], config_path: str) -> list[dict[str, Any]]:
    """Every row of ``paths`` (``.parquet`` and ``.jsonl`` files), file after file, as dicts.

    ``config_path`` is the config key that listed the files (``data.train_files``); errors name it,
    with the file's index. Returns a ``Rows`` list. Raises ``DataError`` for an empty list of files, a
    missing file, an unsupported suffix, a line that is not a JSON object, and a dataset without rows.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [os.fspath(paths)]
    if not paths:
        raise DataError(
            f"{config_path} is empty: list the dataset files ({config_path}=[train.parquet]); "
            f"supported: {_supported()}"
        )
    rows: list[dict[str, Any]] = []
    files: list[tuple[str, int]] = []
    for index, path in enumerate(paths):
        key = f"{config_path}[{index}]"
        path = os.fspath(path)
        file_rows = _read_file(Path(path), key)
        rows.extend(file_rows)
        files.append((path, len(file_rows)))
    if not rows:
        listed = ", ".join(f"'{path}'" for path, _ in files)
        raise DataError(
            f"{config_path}: the dataset is empty, {listed} hold(s) no rows: add rows, or list other files"
        )
    return Rows(rows, files)


def read_file(path: str | os.PathLike, key: str) -> list[dict[str, Any]]:
    """The rows of one ``.parquet`` or ``.jsonl`` file; errors start with ``key`` (``data.train_files[1]``)."""
    return _read_file(Path(path), key)


def _supported() -> str:
    return ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)


def _read_file(path: Path, key: str) -> list[dict[str, Any]]:
    if not path.exists():
        raise DataError(
            f"{key}: file '{path}' not found (a relative path is relative to the working directory, "
            f"{os.getcwd()}): check the path, or give an absolute one"
        )
    if path.is_dir():
        raise DataError(f"{key}: '{path}' is a directory: list the files in it, each one by its path")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path, key)
    if suffix in PARQUET_SUFFIXES:
        return _read_parquet(path, key)
    hint = " (a .json file: write one JSON object per line and name it .jsonl)" if suffix == ".json" else ""
    raise DataError(
        f"{key}: '{path}' has the unsupported suffix '{path.suffix}'{hint}; supported: {_supported()}"
    )


def _read_jsonl(path: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    try:
        # utf-8-sig: a byte order mark (which some editors write) is not part of the first object.
        with path.open(encoding="utf-8-sig") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{key}: '{path}' line {number} is not JSON ({error.msg} at column {error.colno}): "
                        "a JSON Lines file holds one JSON object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise DataError(
                        f"{key}: '{path}' line {number} is a JSON {_json_type(row)}, not an object: each "
                        'line is one row, {"prompt": ..., "other column": ...}'
                    )
                rows.append(row)
    except UnicodeDecodeError as error:
        raise DataError(
            f"{key}: '{path}' is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
            f"{error.start}): save it as UTF-8"
        ) from None
    return rows


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _read_parquet(path: Path, key: str) -> list[dict[str, Any]]:
    try:
        import pyarrow
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DataError(
            f"{key}: reading the Parquet file '{path}' needs pyarrow, which is not installed: "
            "pip install pyarrow (or convert the file to .jsonl)"
        ) from error
    try:
        return parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as error:
        raise DataError(f"{key}: '{path}' could not be read as Parquet: {error}") from error


def row_location(rows: Sequence[Mapping[str, Any]], index: int, config_path: str) -> str:
    """How messages name row ``index``: in its file when ``rows`` came from ``read_rows``."""
    if isinstance(rows, Rows) and rows.files:
        return f"{rows.where(index)} ({config_path})"
    return f"row {index} of {config_path}"


def column_value(
    rows: Sequence[Mapping[str, Any]], index: int, column: str, config_key: str, config_path: str
) -> Any:
    """Row ``index``'s value of ``column``, or a ``DataError`` listing the columns it has."""
    row = rows[index]
    if not isinstance(row, Mapping):
        raise DataError(
            f"{row_location(rows, index, config_path)} is a {type(row).__name__}, not a row: a row maps column "
            "names to values"
        )
    if column in row:
        return row[column]
    columns = [str(name) for name in row]
    listed = ", ".join(f"'{name}'" for name in columns) or "none"
    match = close_match(column, columns)
    advice = f"set {config_key}={match}" if match else f"set {config_key} to the column that holds it"
    raise DataError(
        f"{row_location(rows, index, config_path)} has no column '{column}' ({config_key})"
        f"{did_you_mean(column, columns)}; its columns: {listed}; {advice}"
    )
