"""Plugin discovery, validation, and the registry of everything plugins provide.

Discovery (``get_plugin_manager``): core's internal plugin ``verl_core._builtin``, then every entry
point of the group ``verl_core.plugins``, then the modules named in ``VERL_CORE_PLUGINS``, then
plugin objects passed in. A plugin that fails to import, implements a hook that does not exist, or
is blocked is recorded in a ``PluginInfo`` instead of aborting discovery: the other plugins keep
working, and the failure is reported where it matters (a lookup, ``verl-core plugins``).

Collection (``Registry``): each hook is called once per plugin, so that every descriptor is
attributed to the plugin and distribution that returned it. One generic mechanism serves every
kind; the kinds are the hooks of ``verl_core.hookspecs`` without their ``verl_`` prefix.

Nothing here imports torch or a backend; plugin modules are expected to stay light too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import inspect
import os
import re
import sys
import threading
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs
import pluggy

from verl_core import __version__, hookspecs
from verl_core.descriptors import ENGINE_API_VERSION
from verl_core.errors import (
    ApiVersionError,
    DuplicateNameError,
    PluginError,
    PluginLoadError,
    PluginValidationError,
    UnknownNameError,
)

#: Environment switches (documented in docs/plugins.md).
ENV_DISABLE_AUTOLOAD = "VERL_CORE_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "VERL_CORE_PLUGINS"
ENV_BLOCK = "VERL_CORE_BLOCK_PLUGINS"
ENV_TRACE = "VERL_CORE_TRACE_HOOKS"

HOOK_PREFIX = "verl_"
#: The name under which core's own built-ins are registered.
BUILTIN_PLUGIN = "verl_core"
BUILTIN_MODULE = "verl_core._builtin"

#: First-party names shipped in separate distributions: kind -> name -> (distribution, pip extra).
FIRST_PARTY: dict[str, dict[str, tuple[str, str]]] = {
    "engine_backends": {
        "fsdp": ("verl-fsdp-plugin", "fsdp"),
        "megatron": ("verl-megatron-plugin", "megatron"),
    }
}

PluginStatus = Literal["ok", "broken", "blocked"]
#: ``ok``: resolvable; ``incompatible``: targets another engine API version; ``conflict``: another
#: plugin provides the same name; ``overridden``: another plugin replaced it with ``override=True``.
EntryStatus = Literal["ok", "incompatible", "conflict", "overridden"]


# -- what was found -------------------------------------------------------------------------------


@attrs.frozen
class PluginInfo:
    """One plugin as discovery found it.

    ``name`` is the entry-point name (or the module name of an explicitly loaded plugin);
    ``module`` the module it names; ``status`` is ``ok``, ``broken`` (``error`` says why and
    ``exception`` holds the ``PluginError``, whose ``__cause__`` is the original exception) or
    ``blocked`` (by ``VERL_CORE_BLOCK_PLUGINS``; never imported).
    """

    name: str
    distribution: str | None
    version: str | None
    module: str | None
    status: PluginStatus = "ok"
    error: str | None = None
    exception: PluginError | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def provider(self) -> str:
        """``plugin 'ddp' (verl-ddp 0.1.0)``: how messages name this plugin."""
        return f"plugin '{self.name}' ({_dist_label(self.distribution, self.version)})"


@attrs.frozen
class Entry:
    """One descriptor of one kind, with the plugin that provided it and its status.

    ``error`` explains a status other than ``ok`` (and is what a lookup raises).
    """

    kind: str
    descriptor: Any
    plugin: str
    distribution: str | None
    version: str | None
    status: EntryStatus = "ok"
    error: str | None = None

    @property
    def name(self) -> str:
        return self.descriptor.name

    @property
    def provider(self) -> str:
        return f"plugin '{self.plugin}' ({_dist_label(self.distribution, self.version)})"


def _dist_label(distribution: str | None, version: str | None) -> str:
    if distribution is None:
        return "no distribution"
    return f"{distribution} {version}" if version else distribution


def _normalize_dist(name: str) -> str:
    """PEP 503 normalisation: ``Verl_DDP`` and ``verl-ddp`` name the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_list(variable: str) -> list[str]:
    return [item.strip() for item in os.environ.get(variable, "").split(",") if item.strip()]


def _env_flag(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in ("1", "true", "yes", "on")


# -- the hooks ------------------------------------------------------------------------------------


@attrs.frozen
class HookKind:
    """A hook of ``verl_core.hookspecs`` seen as a registry kind: ``verl_engine_backends`` ->
    ``engine_backends``, whose items are ``EngineBackend`` descriptors."""

    hook: str
    descriptor: type

    @property
    def kind(self) -> str:
        return self.hook.removeprefix(HOOK_PREFIX)

    @property
    def label(self) -> str:
        """Singular, for messages: ``engine backend``."""
        return re.sub(r"(?<!^)(?=[A-Z])", " ", self.descriptor.__name__).lower()

    @property
    def plural(self) -> str:
        return self.kind.replace("_", " ")


def _hook_kinds(pm: pluggy.PluginManager) -> list[HookKind]:
    """Every hook with a spec, in the order of ``hookspecs.py``; the descriptor class is read from
    the spec's return annotation ``list[Descriptor]``."""
    specs = [caller.spec for caller in vars(pm.hook).values() if caller.spec is not None]
    specs.sort(key=lambda spec: spec.function.__code__.co_firstlineno)
    kinds = []
    for spec in specs:
        (descriptor,) = typing.get_args(typing.get_type_hints(spec.function)["return"])
        kinds.append(HookKind(spec.name, descriptor))
    return kinds


def _close_match(name: str, candidates: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _not_a_hook(attribute: str, hook: str, hook_names: list[str]) -> str:
    match = _close_match(hook, hook_names)
    advice = f"did you mean {match}?" if match else f"the hooks are {', '.join(hook_names)}"
    return f"{attribute}() is not a verl-core hook; {advice}"


# -- discovery ------------------------------------------------------------------------------------


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for the ``verl_core`` project, plus a record of every plugin found.

    ``infos`` lists every plugin in discovery order, including broken and blocked ones (which are
    not registered with pluggy). Build it with ``get_plugin_manager``.
    """

    def __init__(self, autoload: bool) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.autoload = autoload
        self.add_hookspecs(hookspecs)
        self.infos: list[PluginInfo] = []
        self.kinds: list[HookKind] = _hook_kinds(self)
        # Entry-point and module names compare exactly, distribution names normalised.
        self._blocked = set(_env_list(ENV_BLOCK))
        self._blocked_distributions = {_normalize_dist(name) for name in self._blocked}

    def info(self, name: str) -> PluginInfo:
        """The record of the registered (ok) plugin ``name``."""
        return next(info for info in self.infos if info.name == name and info.status == "ok")

    def mark_broken(self, name: str, error: PluginError) -> None:
        """Unregister the plugin ``name`` and record it as broken with ``error``."""
        self.unregister(name=name)
        index = next(i for i, info in enumerate(self.infos) if info.name == name and info.status == "ok")
        self.infos[index] = attrs.evolve(
            self.infos[index], status="broken", error=str(error), exception=error
        )

    def load_entry_points(self) -> None:
        """Import and register every entry point of the ``verl_core.plugins`` group."""
        for entry_point in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            distribution, version = _distribution_of(entry_point)
            info = PluginInfo(entry_point.name, distribution, version, entry_point.value)
            if self._is_blocked(info):
                self._record_blocked(info)
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:
                self._record_import_error(info, exc)
                continue
            self.add(plugin, info)

    def load_module(self, module_name: str) -> None:
        """Import and register the module ``module_name`` (``VERL_CORE_PLUGINS``, like PYTEST_PLUGINS)."""
        info = _explicit_plugin_info(module_name)
        if self._is_blocked(info):
            self._record_blocked(info)
            return
        try:
            plugin = importlib.import_module(module_name)
        except Exception as exc:
            self._record_import_error(info, exc)
            return
        self.add(plugin, info)

    def add(self, plugin: object, info: PluginInfo) -> None:
        """Validate ``plugin``'s hook names and register it; record it as ok or broken."""
        if self.is_registered(plugin):
            return  # the same module reached twice (entry point and VERL_CORE_PLUGINS)
        problems = self._hook_name_problems(plugin)
        if problems:
            error = PluginValidationError(f"{info.provider}: " + "; ".join(problems))
            self._record_broken(info, error)
            return
        if info.name in self._name2plugin:
            other = next(other for other in self.infos if other.name == info.name)
            error = PluginValidationError(
                f"{info.provider}: the plugin name '{info.name}' is already used by {other.provider}; "
                f"rename one entry point, uninstall one distribution, or block one with {ENV_BLOCK}"
            )
            self._record_broken(info, error)
            return
        try:
            self.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:  # a hookimpl whose arguments the spec lacks
            self.unregister(plugin=plugin, name=info.name)
            error = PluginValidationError(f"{info.provider}: {exc}")
            error.__cause__ = exc
            self._record_broken(info, error)
            return
        self.infos.append(info)

    def _is_blocked(self, info: PluginInfo) -> bool:
        if info.name in self._blocked or info.module in self._blocked:
            return True
        return (
            info.distribution is not None
            and _normalize_dist(info.distribution) in self._blocked_distributions
        )

    def _record_broken(self, info: PluginInfo, error: PluginError) -> None:
        self.infos.append(attrs.evolve(info, status="broken", error=str(error), exception=error))

    def _record_blocked(self, info: PluginInfo) -> None:
        self.set_blocked(info.name)
        self.infos.append(attrs.evolve(info, status="blocked", error=f"blocked by {ENV_BLOCK}"))

    def _record_import_error(self, info: PluginInfo, exc: Exception) -> None:
        error = PluginLoadError(
            f"{info.provider} failed to import '{info.module}': {type(exc).__name__}: {exc}. "
            f"Fix or upgrade {info.distribution or 'the module'}, or block it with {ENV_BLOCK}={info.name}"
        )
        error.__cause__ = exc
        self._record_broken(info, error)

    def _hook_name_problems(self, plugin: object) -> list[str]:
        """Misspelled hooks: ``@hookimpl`` functions whose hook does not exist (what pluggy's
        ``check_pending`` reports), and functions named ``verl_*`` that are not hooks or lack
        ``@hookimpl`` (pluggy ignores those silently)."""
        hook_names = [kind.hook for kind in self.kinds]
        problems = []
        for attribute in dir(plugin):
            try:
                if not inspect.isroutine(getattr(plugin, attribute)):
                    continue
                options = self.parse_hookimpl_opts(plugin, attribute)
            except Exception:  # a property that raises is not a hook implementation
                continue
            if options is not None:
                hook = options.get("specname") or attribute
                if hook not in hook_names and not options.get("optionalhook"):
                    problems.append("@hookimpl " + _not_a_hook(attribute, hook, hook_names))
            elif attribute in hook_names:
                problems.append(f"{attribute}() is not decorated with @verl_core.hookimpl")
            elif attribute.startswith(HOOK_PREFIX):
                problems.append(_not_a_hook(attribute, attribute, hook_names))
        return problems


def _distribution_of(entry_point: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = entry_point.dist
    return (dist.name, dist.version) if dist is not None else (None, None)


def _explicit_plugin_info(module_name: str) -> PluginInfo:
    """A module loaded by name keeps the name and distribution of the entry point naming it, if any."""
    for entry_point in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        if entry_point.value == module_name:
            return PluginInfo(entry_point.name, *_distribution_of(entry_point), module_name)
    return PluginInfo(module_name, None, None, module_name)


def get_plugin_manager(autoload: bool | None = None, plugins: Sequence[object] = ()) -> PluginManager:
    """Discover plugins: core's built-ins, entry points (unless autoload is off), the modules in
    ``VERL_CORE_PLUGINS``, then ``plugins`` (module objects, plugin objects, or module names).

    ``autoload=None`` follows ``VERL_CORE_DISABLE_PLUGIN_AUTOLOAD``. Failures are recorded in
    ``pm.infos``, never raised. ``VERL_CORE_TRACE_HOOKS=1`` traces every hook call to stderr.
    """
    if autoload is None:
        autoload = not _env_flag(ENV_DISABLE_AUTOLOAD)
    pm = PluginManager(autoload)
    if _env_flag(ENV_TRACE):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    builtin = importlib.import_module(BUILTIN_MODULE)
    pm.add(builtin, PluginInfo(BUILTIN_PLUGIN, "verl-core", __version__, BUILTIN_MODULE))
    if autoload:
        pm.load_entry_points()
    for module_name in _env_list(ENV_PLUGINS):
        pm.load_module(module_name)
    for plugin in plugins:
        if isinstance(plugin, str):
            pm.load_module(plugin)
        elif isinstance(plugin, types.ModuleType):
            pm.add(plugin, _explicit_plugin_info(plugin.__name__))
        else:  # a plugin object: a class or instance with hook methods
            name = getattr(plugin, "__name__", None) or type(plugin).__qualname__
            pm.add(plugin, PluginInfo(name, None, None, getattr(plugin, "__module__", None)))
    return pm


# -- the registry ---------------------------------------------------------------------------------


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
    def kinds(self) -> list[str]:
        """``engine_backends``, ``advantage_estimators``, ...: the hooks without ``verl_``."""
        return list(self._kinds)

    @property
    def plugins(self) -> list[PluginInfo]:
        """Every plugin found, in discovery order, with its status."""
        return list(self.plugin_manager.infos)

    def names(self, kind: str) -> list[str]:
        """Sorted names of ``kind`` that some loaded plugin provides (conflicting ones included)."""
        return sorted({entry.name for entry in self._of_kind(kind)})

    def entries(self, kind: str) -> list[Entry]:
        """Every descriptor of ``kind`` with its provider and status, in discovery order."""
        return list(self._of_kind(kind))

    def get(self, kind: str, name: str, *, where: str | None = None) -> Any:
        """The descriptor of ``kind`` named ``name``.

        Raises ``UnknownNameError`` (chained to a broken plugin's error, if any), ``DuplicateNameError``
        or ``ApiVersionError``. ``where`` names the config key the name came from, for the message.
        """
        return self.entry(kind, name, where=where).descriptor

    def entry(self, kind: str, name: str, *, where: str | None = None) -> Entry:
        """Like ``get``, but the ``Entry``: the descriptor with the plugin that provides it."""
        group = [entry for entry in self._of_kind(kind) if entry.name == name]
        if not group:
            raise self._unknown_name_error(self._kinds[kind], name, where)
        entry = next(entry for entry in group if entry.status != "overridden")
        if entry.status == "conflict":
            raise DuplicateNameError(entry.error)
        if entry.status == "incompatible":
            raise ApiVersionError(entry.error)
        return entry

    def _of_kind(self, kind: str) -> list[Entry]:
        if kind not in self._entries:
            raise UnknownNameError(f"Unknown registry kind '{kind}'; the kinds are {', '.join(self._kinds)}.")
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
                        entries.append(Entry(kind.kind, descriptor, name, info.distribution, info.version))
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
            results = caller()
        except Exception as exc:
            error = PluginLoadError(
                f"{info.provider}: hook {kind.hook}() raised {type(exc).__name__}: {exc}. "
                f"Fix or upgrade {info.distribution or info.module}, or block it with {ENV_BLOCK}={info.name}"
            )
            raise error from exc
        if len(results) < len(implementations):  # pluggy drops None results
            results = [*results, None]
        descriptors = []
        for returned in results:
            if not isinstance(returned, (list, tuple)):
                raise self._type_error(info, kind, f"{type(returned).__name__} {_short_repr(returned)}")
            for position, item in enumerate(returned):
                if not isinstance(item, kind.descriptor):
                    got = f"item {position} is {type(item).__name__} {_short_repr(item)}"
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
        lines = [f"Unknown {kind.label} '{name}'{source}."]
        if installed:
            listed = ", ".join(
                f"{entry.name} ({_dist_label(entry.distribution, entry.version)})" for entry in installed
            )
            lines.append(f"Installed {kind.plural}: {listed}.")
        else:
            lines.append(f"No {kind.plural} are installed.")
        # First-party names count as candidates even when not installed: 'megatorn' -> 'megatron'.
        first_party_names = FIRST_PARTY.get(kind.kind, {})
        match = _close_match(name, {entry.name for entry in installed} | set(first_party_names))
        if match and match != name:
            lines.append(f"Did you mean '{match}'?")
        hinted = name if name in first_party_names else match
        if hinted in first_party_names and hinted not in {entry.name for entry in installed}:
            lines.append(self._first_party_hint(kind, hinted, *first_party_names[hinted]))
        broken = [info for info in self.plugin_manager.infos if info.status != "ok"]
        for info in broken:
            detail = info.error if info.status == "broken" else f"{info.provider} is {info.error}"
            lines.append(f"Note: a {info.status} plugin might provide it: {detail}")
        lines.append("Run `verl-core plugins --all` to see every plugin and what it provides.")
        error = UnknownNameError("\n".join(lines))
        error.__cause__ = next((info.exception for info in broken if info.exception is not None), None)
        return error

    def _first_party_hint(self, kind: HookKind, name: str, distribution: str, extra: str) -> str:
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return f"The '{name}' {kind.label} ships in {distribution}: pip install \"verl-core[{extra}]\""
        hint = f"{distribution} {version} is installed but provides no '{name}' {kind.label}"
        loaded = [
            info
            for info in self.plugin_manager.infos
            if info.distribution and _normalize_dist(info.distribution) == _normalize_dist(distribution)
        ]
        if not loaded and not self.plugin_manager.autoload:
            return f"{hint}: plugin autoload is disabled ({ENV_DISABLE_AUTOLOAD}=1); list its module in {ENV_PLUGINS}."
        if any(info.status != "ok" for info in loaded):
            return f"{hint}: its plugin is not loaded (see the note below)."
        if not loaded:
            return (
                f"{hint}: this release declares no '{hookspecs.ENTRY_POINT_GROUP}' entry point, so it "
                f"provides no plugins at all. Install a release of {distribution} that provides '{name}' "
                f'(its release notes say which) with pip install -U "verl-core[{extra}]"'
            )
        return f'{hint}; reinstall a matching release: pip install --force-reinstall "verl-core[{extra}]"'


def _resolve(kind: HookKind, group: list[Entry]) -> list[Entry]:
    """Statuses for the providers of one name: a single provider, or exactly one ``override=True``,
    wins; otherwise all conflict. The winner is incompatible if it targets another engine API."""
    overrides = [entry for entry in group if entry.descriptor.override]
    if len(group) > 1 and len(overrides) != 1:
        providers = " and ".join(entry.provider for entry in group)
        reason = (
            f"several of them mark override=True ({', '.join(e.provider for e in overrides)}); only one may"
            if overrides
            else "none of them marks override=True"
        )
        error = (
            f"{kind.label} '{group[0].name}' is provided by {providers}: {reason}. Fix: set override=True "
            f"on the {kind.descriptor.__name__} that should win, uninstall one distribution, or block one "
            f"plugin with {ENV_BLOCK}=<plugin or distribution>."
        )
        return [attrs.evolve(entry, status="conflict", error=error) for entry in group]
    winner = next((i for i, entry in enumerate(group) if entry.descriptor.override), 0)
    resolved = [
        attrs.evolve(entry, status="overridden", error=f"overridden by {group[winner].provider}")
        if i != winner
        else entry
        for i, entry in enumerate(group)
    ]
    api_version = getattr(group[winner].descriptor, "api_version", ENGINE_API_VERSION)
    if api_version != ENGINE_API_VERSION:
        resolved[winner] = attrs.evolve(
            group[winner], status="incompatible", error=_api_mismatch(kind, group[winner], api_version)
        )
    return resolved


def _api_mismatch(kind: HookKind, entry: Entry, api_version: int) -> str:
    if api_version > ENGINE_API_VERSION:
        upgrade = "Upgrade verl-core (pip install -U verl-core)"
    elif entry.distribution:
        upgrade = f"Upgrade {entry.distribution} (pip install -U {entry.distribution})"
    else:
        upgrade = f"Upgrade plugin '{entry.plugin}'"
    return (
        f"{kind.label} '{entry.name}' from {entry.provider} targets engine API version {api_version}, "
        f"but verl-core {__version__} speaks engine API version {ENGINE_API_VERSION}. "
        f"{upgrade} so that both speak the same version."
    )


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
