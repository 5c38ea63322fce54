"""What ``verl-core plugins`` shows: a row per engine backend (or per plugin without one), a row per
descriptor of the other kinds, the problems the default listing must not hide, and the plain-text
table they print as."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from verl_core.hookspecs import Kind
from verl_core.plugins.discovery import PluginInfo
from verl_core.plugins.registry import Entry, Registry

#: Keys of one ``verl-core plugins --json`` row, in table order.
BACKEND_COLUMNS = (
    "plugin",
    "backend",
    "distribution",
    "version",
    "devices",
    "roles",
    "api_version",
    "status",
    "error",
)
#: Keys of one row of the other registries (``--all``).
ENTRY_COLUMNS = ("name", "plugin", "distribution", "version", "status", "description", "error")
#: Keys of one rollout backend's row: also the rollout API version it targets and what it declares it
#: can do (``RolloutCapabilities``: one line in the table, an object in ``--json``).
ROLLOUT_COLUMNS = (
    "name",
    "plugin",
    "distribution",
    "version",
    "api_version",
    "capabilities",
    "status",
    "description",
    "error",
)


def columns_of(kind: str) -> tuple[str, ...]:
    """The columns of ``kind``'s table (``--all``)."""
    return ROLLOUT_COLUMNS if kind == Kind.ROLLOUT_BACKENDS else ENTRY_COLUMNS


def _problems(registry: Registry, plugin: str) -> list[Entry]:
    """The entries of ``plugin`` outside the engine backends that cannot be used as they stand. An
    ``unavailable`` one (an optional extra whose package is not installed: core's ``wandb`` sink) is a
    problem only of a plugin that offers nothing usable without it: selecting it is refused with its
    pip command anyway, and ``--all`` lists it."""
    provided = [
        entry for kind in registry.kinds for entry in registry.entries(kind) if entry.plugin == plugin
    ]
    usable = any(entry.status == "ok" for entry in provided)
    return [
        entry
        for entry in provided
        if entry.kind != Kind.ENGINE_BACKENDS
        and entry.status not in ("ok", "overridden")
        and not (usable and entry.status == "unavailable")
    ]


def problem_notes(registry: Registry) -> list[str]:
    """One line per estimator, loss, rollout or reward that conflicts, is incompatible or broken: the
    default listing shows only engine backends, and these must not look fine there."""
    return [
        f"  {entry.kind} '{entry.name}' from {entry.provider}: {entry.status}: {entry.error}"
        for info in registry.plugins
        for entry in _problems(registry, info.name)
    ]


def backend_rows(registry: Registry) -> list[dict[str, Any]]:
    """One row per engine backend; a plugin without backends (or broken, or blocked) gets one row
    with an empty backend, so that every plugin appears. That row's status is the plugin's own, or
    the worst of what it provides besides backends (a policy loss clashing with a built-in shows
    as ``conflict``, not ``ok``)."""
    backends = registry.entries(Kind.ENGINE_BACKENDS)
    rows = []
    for info in registry.plugins:
        provided = [entry for entry in backends if entry.plugin == info.name] if info.status == "ok" else []
        rows += [_backend_row(info, entry) for entry in provided] or [
            _plugin_row(info, _problems(registry, info.name))
        ]
    return rows


def _plugin_row(info: PluginInfo, problems: list[Entry]) -> dict[str, Any]:
    row = _backend_row(info, None)
    if info.status == "ok" and problems:
        row["status"] = problems[0].status
        row["error"] = " ".join(f"{entry.kind} '{entry.name}': {entry.error}" for entry in problems)
    return row


def _backend_row(info: PluginInfo, entry: Entry | None) -> dict[str, Any]:
    backend = entry.descriptor if entry else None
    return {
        "plugin": info.name,
        "backend": backend.name if backend else None,
        "distribution": info.distribution,
        "version": info.version,
        "devices": list(backend.devices) if backend else [],
        "roles": list(backend.roles) if backend else [],
        "api_version": backend.api_version if backend else None,
        "status": entry.status if entry else info.status,
        "error": entry.error if entry else info.error,
    }


def entry_rows(registry: Registry, kind: str) -> list[dict[str, Any]]:
    """One row per descriptor of ``kind`` (``--all``), with the keys of ``columns_of(kind)``."""
    rows = []
    for entry in registry.entries(kind):
        row = {
            "name": entry.name,
            "plugin": entry.plugin,
            "distribution": entry.distribution,
            "version": entry.version,
            "status": entry.status,
            "description": entry.descriptor.description,
            "error": entry.error,
        }
        if kind == Kind.ROLLOUT_BACKENDS:
            capabilities = entry.descriptor.capabilities
            row["api_version"] = entry.descriptor.api_version
            # Choices are strings (JSON writes their values); the dtypes a list.
            row["capabilities"] = {
                name: list(value) if isinstance(value, tuple) else value
                for name, value in attrs.asdict(capabilities, recurse=False).items()
            }
        rows.append({column: row[column] for column in columns_of(kind)})
    return rows


def format_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain-text table: a header, then one line per row; lists are comma-joined, None is empty."""

    def cell(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, list):
            return ",".join(map(str, value))
        if isinstance(value, dict):  # a rollout's capabilities: the flags that are on, and the values
            return " ".join(
                name
                if item is True
                else f"{name}={'/'.join(map(str, item)) if isinstance(item, list) else item}"
                for name, item in value.items()
                if item is not False
            )
        return " ".join(str(value).split())  # one line per row, even for multi-line errors

    lines = [list(columns)] + [[cell(row[column]) for column in columns] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
