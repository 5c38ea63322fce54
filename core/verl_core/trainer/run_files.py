"""The run folder's files: the metrics file (one JSON object per step) and the validation samples,
written atomically and read back tolerating only a last line a crash cut short; the record of which
step the Hugging Face export holds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verl_core.errors import VerlCoreError

#: The run folder's file of metrics: one JSON object per line, ``{"step": N, "<key>": value, ...}``.
METRICS_FILE = "metrics.jsonl"
#: The run folder's folder of TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"
#: The run folder's folder of the metric sinks' state: ``<sink>.json``, the tracker's run id and the last
#: step it accepted (``verl_core.trainer.sinks``), for a resumed run to continue the same tracker run.
TRACKING_DIR = "tracking"
#: The run folder's folder of a few generations per validation, ``step_<N>.jsonl``.
VALIDATION_DIR = "validation"
#: The file in a run's Hugging Face export that records the step of its weights, ``{"global_step": N}``:
#: written once the export is whole, so that an export a stop cut off (or an earlier one of a shorter run)
#: is told from the one the run ends with.
EXPORT_RECORD = "verl_export.json"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The objects of a metrics JSONL file, in order (none if it does not exist).

    A last line without its newline that does not parse is a write cut short by a crash, and is
    left out; any other line that is not a JSON object with an integer ``step`` is a ``VerlCoreError``
    naming the file and the line.
    """
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the last line, without its newline: a crash mid-write
                continue
            raise VerlCoreError(f"{path}:{number}: not JSON ({error}); repair or delete that line") from None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise VerlCoreError(
                f'{path}:{number}: not a metrics line (a JSON object with an integer "step"); '
                "repair or delete that line"
            )
        records.append(record)
    return records


def _jsonable(value: Any) -> Any:
    """``value`` with every NaN or infinity, however deep in lists and dicts, as ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


def write_jsonl(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``records`` to ``path``, one JSON object per line, and return the path.

    Parent folders are made; the file is replaced atomically (a crash leaves the old file or the new
    one, never half of one). Text stays readable (no ``\\u`` escapes); NaN and infinities become
    ``null``. The trainer writes validation generations with it to ``validation_samples_path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(_jsonable(dict(record)), ensure_ascii=False, allow_nan=False) + "\n")
    os.replace(partial, path)
    return path


def validation_samples_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Where the generations of the validation at ``step`` go: ``run_dir/validation/step_<step>.jsonl``."""
    return Path(run_dir) / VALIDATION_DIR / f"step_{step}.jsonl"


def record_export(export: str | os.PathLike[str], step: int) -> None:
    """Record that the Hugging Face export folder ``export`` holds the weights of ``step`` (one JSON
    object, written atomically)."""
    write_jsonl(Path(export) / EXPORT_RECORD, [{"global_step": step}])


def exported_step(export: str | os.PathLike[str]) -> int | None:
    """The step whose weights the Hugging Face export folder ``export`` holds (``record_export``), or
    None when it holds no recorded, whole export."""
    try:
        return int(json.loads((Path(export) / EXPORT_RECORD).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
