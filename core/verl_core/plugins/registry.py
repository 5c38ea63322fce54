"""The registry of everything plugins provide, by kind and name, with who provided it.

Collection calls each hook once per plugin, so that every descriptor is attributed to the plugin and
distribution that returned it. One generic mechanism serves every kind; the kinds (``Kind``) are the hooks of
``verl_core.hookspecs`` without their ``verl_`` prefix (``Kind.ENGINE_BACKENDS``, ...).
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from verl_core.descriptors import load_object, providing
from verl_core.errors import (
    ApiVersionError,
    DuplicateNameError,
    PluginError,
    PluginLoadError,
    PluginValidationError,
    UnknownNameError,
    close_match,
    did_you_mean,
)
from verl_core.hookspecs import Kind
from verl_core.plugins import messages
from verl_core.plugins.discovery import (
    HookKind,
    PluginInfo,
    PluginManager,
    get_plugin_manager,
    same_distribution,
)

#: ``ok``: resolvable; ``incompatible``: targets another engine (or rollout) API version; ``conflict``:
#: another plugin provides the same name; ``overridden``: another plugin replaced it with ``override=True``;
#: ``broken``: one of its import strings names a module that cannot be found; ``unavailable``: a module it
#: ``requires`` (a package its distribution cannot depend on, such as vLLM) is not installed.
EntryStatus = Literal["ok", "incompatible", "conflict", "overridden", "broken", "unavailable"]

#: Descriptor fields that hold import strings, checked (without importing) when the registry is built.
IMPORT_FIELDS = ("engine", "config", "rollout", "function", "sink", "start", "options", "transport")


@attrs.frozen
class Entry:
    """One descriptor of one kind, with the plugin that provided it and its status.

    ``error`` explains a status other than ``ok`` (and is what a lookup raises).
    """

    kind: Kind
    descriptor: Any
    plugin: str
    distribution: str | None
    version: str | None
    label: str = "descriptor"
    status: EntryStatus = "ok"
    error: str | None = None

    @property
    def name(self) -> str:
        return self.descriptor.name

    @property
    def provider(self) -> str:
        return messages.provider(self.plugin, self.distribution, self.version)

    def load(self, field: str) -> Any:
        """Import the object the descriptor's ``field`` names (``engine``, ``config``, ``function``).

        Raises ``PluginLoadError`` naming the descriptor, the plugin, its distribution and the import
        string, chained to the original error.
        """
        target = getattr(self.descriptor, field)
        try:
            return load_object(target)
        except Exception as exc:
            message = messages.unimportable(
                self.label, self.name, self.provider, field, target, f"{type(exc).__name__}: {exc}"
            )
            raise PluginLoadError(message) from exc


class Registry:
    """Everything the plugins provide, by kind and name, with who provided it.

    ``get(kind, name)`` returns the descriptor or raises an error that names the plugins and
    distributions involved and the fix; ``entries(kind)`` lists every descriptor with its status,
    including conflicting and incompatible ones, so that listing never raises.
    """

    def __init__(self, plugin_manager: PluginManager):
        self.plugin_manager = plugin_manager
        self._kinds = {kind.kind: kind for kind in plugin_manager.kinds}
        collected = self._collect()
        # Per kind, in discovery order, each entry with the status its name's resolution gives it.
        self._entries: dict[str, list[Entry]] = {}
        for kind in self._kinds.values():
            entries = [entry for entry in collected if entry.kind == kind.kind]
            positions: dict[str, list[int]] = {}
            for position, entry in enumerate(entries):
                positions.setdefault(entry.name, []).append(position)
            for same_name in positions.values():
                resolved = _resolve(kind, [entries[position] for position in same_name])
                for position, entry in zip(same_name, resolved, strict=True):
                    entries[position] = entry
            self._entries[kind.kind] = entries

    @classmethod
    def from_plugins(cls, plugins: Sequence[object] = (), autoload: bool = False) -> Registry:
        """Core's built-ins plus ``plugins`` (and entry points when ``autoload``): for tests."""
        return cls(get_plugin_manager(autoload=autoload, plugins=plugins))

    @property
    def kinds(self) -> list[Kind]:
        """``Kind.ENGINE_BACKENDS``, ...: the hooks without ``verl_``, in the hooks' order."""
        return list(self._kinds)

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin found, in discovery order, with its status."""
        return list(self.plugin_manager.infos)

    def names(self, kind: Kind | str) -> list[str]:
        """Sorted names of ``kind`` that some loaded plugin provides (conflicting ones included)."""
        return sorted({entry.name for entry in self._of_kind(kind)})

    def entries(self, kind: Kind | str) -> list[Entry]:
        """Every descriptor of ``kind`` with its provider and status, in discovery order."""
        return list(self._of_kind(kind))

    def get(self, kind: Kind | str, name: str, *, where: str | None = None) -> Any:
        """The descriptor of ``kind`` named ``name``.

        Raises ``UnknownNameError`` (chained to a broken plugin's error, if any), ``DuplicateNameError``,
        ``ApiVersionError`` or ``PluginLoadError`` (an import string that names no module). ``where``
        names the config key the name came from, for the message.
        """
        return self.entry(kind, name, where=where).descriptor

    def entry(self, kind: Kind | str, name: str, *, where: str | None = None) -> Entry:
        """Like ``get``, but the ``Entry``: the descriptor with the plugin that provides it; its
        ``load(field)`` imports what the descriptor names with errors attributed to the plugin."""
        group = [entry for entry in self._of_kind(kind) if entry.name == name]
        if not group:
            raise self._unknown_name_error(self._kinds[Kind(kind)], name, where)
        entry = next(entry for entry in group if entry.status != "overridden")
        errors = {
            "conflict": DuplicateNameError,
            "incompatible": ApiVersionError,
            "broken": PluginLoadError,
            "unavailable": PluginLoadError,
        }
        if entry.status in errors:
            raise errors[entry.status](entry.error)
        return entry

    def _of_kind(self, kind: Kind | str) -> list[Entry]:
        if kind not in self._entries:
            raise UnknownNameError(
                f"Unknown registry kind '{kind}'; the kinds are {', '.join(self._kinds)} (verl_core.plugins.Kind)."
            )
        return self._entries[kind]

    def _collect(self) -> list[Entry]:
        """Call every hook once per plugin and validate what it returns."""
        pm = self.plugin_manager
        entries: list[Entry] = []
        for name, plugin in list(pm.list_name_plugin()):
            if plugin is None:  # blocked
                continue
            info = pm.info(name)
            others = [other for other in pm.get_plugins() if other is not plugin]
            try:
                for kind in pm.kinds:
                    for descriptor in self._call(plugin, info, kind, others):
                        entries.append(
                            Entry(kind.kind, descriptor, name, info.distribution, info.version, kind.label)
                        )
            except PluginError as error:
                pm.mark_broken(name, error)
                entries = [entry for entry in entries if entry.plugin != name]
        return entries

    def _call(self, plugin: object, info: PluginInfo, kind: HookKind, others: list[object]) -> list[Any]:
        caller = self.plugin_manager.subset_hook_caller(kind.hook, remove_plugins=others)
        implementations = [impl for impl in caller.get_hookimpls() if not (impl.wrapper or impl.hookwrapper)]
        if not implementations:
            return []
        try:
            with providing(info.provider):
                results = caller()
        except Exception as exc:
            error = PluginLoadError(
                f"{info.provider}: hook {kind.hook}() raised {type(exc).__name__}: {exc}. "
                + messages.fix_plugin(info.distribution, info.module, info.name)
            )
            raise error from exc
        if len(results) < len(implementations):  # pluggy drops None results
            results = [*results, None]
        descriptors = []
        for returned in results:
            if not isinstance(returned, (list, tuple)):
                got = f"{type(returned).__name__} {messages.short_repr(returned)}"
                raise self._type_error(info, kind, got)
            for position, item in enumerate(returned):
                if not isinstance(item, kind.descriptor):
                    got = f"item {position} is {type(item).__name__} {messages.short_repr(item)}"
                    raise self._type_error(info, kind, got)
            descriptors.extend(returned)
        return descriptors

    @staticmethod
    def _type_error(info: PluginInfo, kind: HookKind, got: str) -> PluginValidationError:
        return PluginValidationError(
            f"{info.provider}: hook {kind.hook}() must return a list of {kind.descriptor.__name__} "
            f"(from verl_core); got {got}. Return [{kind.descriptor.__name__}(...), ...]"
        )

    def _unknown_name_error(self, kind: HookKind, name: str, where: str | None) -> UnknownNameError:
        installed = self.entries(kind.kind)
        source = f" (from {where})" if where else ""
        candidates = {entry.name for entry in installed} | set(messages.FIRST_PARTY.get(kind.kind, {}))
        lines = [f"Unknown {kind.label} '{name}'{source}{did_you_mean(name, candidates)}."]
        if installed:
            listed = ", ".join(
                f"{entry.name} ({messages.dist_label(entry.distribution, entry.version)})"
                for entry in installed
            )
            lines.append(f"Installed {kind.plural}: {listed}.")
        else:
            lines.append(f"No {kind.plural} are installed.")
        # First-party names count as candidates even when not installed: 'megatorn' -> 'megatron'.
        first_party = messages.FIRST_PARTY.get(kind.kind, {})
        installed_names = {entry.name for entry in installed}
        match = close_match(name, candidates)
        hinted = name if name in first_party else match
        if hinted in first_party and hinted not in installed_names:
            distribution, extra = first_party[hinted]
            loaded = [
                info
                for info in self.plugin_manager.infos
                if info.distribution and same_distribution(info.distribution, distribution)
            ]
            hint = messages.first_party_hint(
                kind.label, hinted, distribution, extra, loaded, self.plugin_manager.autoload
            )
            lines.append(hint)
        broken = [info for info in self.plugin_manager.infos if info.status != "ok"]
        for info in broken:
            detail = info.error if info.status == "broken" else f"{info.provider} is {info.error}"
            lines.append(f"Note: a {info.status} plugin might provide it: {detail}")
        lines.append("Run `verl-core plugins --all` to see every plugin and what it provides.")
        error = UnknownNameError("\n".join(lines))
        error.__cause__ = next((info.exception for info in broken if info.exception is not None), None)
        return error


def _resolve(kind: HookKind, group: list[Entry]) -> list[Entry]:
    """Statuses for the providers of one name: a single provider, or exactly one ``override=True``,
    wins; otherwise all conflict. The winner is incompatible if it targets an engine (rollout) API version
    core does not speak, broken if one of its import strings names a module that cannot be found, and
    unavailable if a module it ``requires`` is not installed."""
    overrides = [entry for entry in group if entry.descriptor.override]
    if len(group) > 1 and len(overrides) != 1:
        error = messages.conflict(
            kind.label,
            kind.descriptor.__name__,
            group[0].name,
            [entry.provider for entry in group],
            [entry.provider for entry in overrides],
        )
        return [attrs.evolve(entry, status="conflict", error=error) for entry in group]
    winner = next((i for i, entry in enumerate(group) if entry.descriptor.override), 0)
    resolved = [
        attrs.evolve(entry, status="overridden", error=f"overridden by {group[winner].provider}")
        if i != winner
        else entry
        for i, entry in enumerate(group)
    ]
    entry = group[winner]
    versions = messages.API_VERSIONS.get(kind.kind)
    api_version = getattr(entry.descriptor, "api_version", None)
    if versions is not None and not versions[1] <= api_version <= versions[2]:
        error = messages.api_mismatch(
            kind.label, entry.name, entry.provider, entry.distribution, entry.plugin, api_version, kind.kind
        )
        resolved[winner] = attrs.evolve(entry, status="incompatible", error=error)
    elif (problem := _missing_module(entry)) is not None:
        resolved[winner] = attrs.evolve(entry, status="broken", error=problem)
    elif (problem := _missing_requirement(entry)) is not None:
        resolved[winner] = attrs.evolve(entry, status="unavailable", error=problem)
    return resolved


def _missing_module(entry: Entry) -> str | None:
    """Why an import string of ``entry`` cannot resolve, found without importing its module (listing
    must stay fast and torch-free); ``None`` when every named module exists. Attributes are checked
    when the object is loaded (``Entry.load``)."""
    for field in IMPORT_FIELDS:
        target = getattr(entry.descriptor, field, None)
        if not isinstance(target, str):
            continue
        module = target.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except Exception as exc:  # a parent package that raises on import, or is not a package
            return messages.unimportable(
                entry.label, entry.name, entry.provider, field, target, f"{type(exc).__name__}: {exc}"
            )
        if not found:
            return messages.unimportable(
                entry.label, entry.name, entry.provider, field, target, f"no module named '{module}'"
            )
    return None


def _missing_requirement(entry: Entry) -> str | None:
    """Why ``entry`` cannot be used on this machine: the first module it ``requires`` that is not
    installed, with the command that installs it; ``None`` when each is (found without importing it)."""
    for module in getattr(entry.descriptor, "requires", ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except Exception:  # a parent package that raises on import: not usable either
            found = False
        if not found:
            return messages.unavailable(
                entry.label, entry.name, entry.provider, module, entry.descriptor.install
            )
    return None


# -- the process-wide registry --------------------------------------------------------------------

_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, built on first use; ``refresh=True`` rediscovers the plugins."""
    global _registry
    with _registry_lock:
        if _registry is None or refresh:
            _registry = Registry(get_plugin_manager())
        return _registry


def registry_or_installed(registry: Registry | None) -> Registry:
    """``registry``, or the process-wide one of the installed plugins when ``None``: what every
    function taking an optional ``registry`` looks names up in."""
    return registry if registry is not None else get_registry()
