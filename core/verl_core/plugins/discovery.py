"""Finding plugins: core's built-ins, entry points, modules named in the environment, objects passed in.

A plugin that fails to import, implements a hook that does not exist, or is blocked is recorded in a
``PluginInfo`` instead of aborting discovery: the other plugins keep working, and the failure is
reported where it matters (a lookup, ``verl-core plugins``).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import inspect
import re
import sys
import types
import typing
import warnings
from collections.abc import Sequence
from typing import Literal

import attrs
import pluggy

from verl_core import __version__, hookspecs
from verl_core.descriptors import providing
from verl_core.errors import PluginError, PluginLoadError, PluginValidationError, PluginWarning
from verl_core.plugins import messages
from verl_core.plugins.switches import ENV_BLOCK, Switches

#: The name under which core's own built-ins are registered.
BUILTIN_PLUGIN = "verl_core"
BUILTIN_MODULE = "verl_core._builtin"

PluginStatus = Literal["ok", "broken", "blocked"]


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
        return messages.provider(self.name, self.distribution, self.version)


@attrs.frozen
class HookKind:
    """A hook of ``verl_core.hookspecs`` seen as a registry kind: ``verl_engine_backends`` ->
    ``engine_backends``, whose items are ``EngineBackend`` descriptors."""

    hook: str
    descriptor: type

    @property
    def kind(self) -> hookspecs.Kind:
        return hookspecs.Kind(self.hook.removeprefix(hookspecs.HOOK_PREFIX))

    @property
    def label(self) -> str:
        """Singular, for messages: ``engine backend``."""
        return re.sub(r"(?<!^)(?=[A-Z])", " ", self.descriptor.__name__).lower()

    @property
    def plural(self) -> str:
        return self.kind.replace("_", " ")


def hook_kinds(pm: pluggy.PluginManager) -> list[HookKind]:
    """Every hook with a spec, in the order of ``hookspecs.py``; the descriptor class is read from
    the spec's return annotation ``list[Descriptor]``."""
    callers = [getattr(pm.hook, name) for name in dir(pm.hook) if name.startswith(hookspecs.HOOK_PREFIX)]
    specs = [caller.spec for caller in callers if caller.spec is not None]
    specs.sort(key=lambda spec: spec.function.__code__.co_firstlineno)
    kinds = []
    for spec in specs:
        (descriptor,) = typing.get_args(typing.get_type_hints(spec.function)["return"])
        kinds.append(HookKind(spec.name, descriptor))
    return kinds


def _normalize_dist(name: str) -> str:
    """PEP 503 normalisation: ``Verl_DDP`` and ``verl-ddp`` name the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def same_distribution(a: str, b: str) -> bool:
    """Whether two distribution names name one distribution (``Verl_DDP`` and ``verl-ddp`` do)."""
    return _normalize_dist(a) == _normalize_dist(b)


class PluginManager(pluggy.PluginManager):
    """pluggy's manager for the ``verl_core`` project, plus a record of every plugin found.

    ``infos`` lists every plugin in discovery order, including broken and blocked ones (which are
    not registered with pluggy). Build it with ``get_plugin_manager``.
    """

    def __init__(self, autoload: bool, blocked: Sequence[str] = ()) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.autoload = autoload
        self.add_hookspecs(hookspecs)
        self.infos: list[PluginInfo] = []
        self.kinds: list[HookKind] = hook_kinds(self)
        # Entry-point and module names compare exactly, distribution names normalised.
        self._blocked = set(blocked)
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
                with providing(info.provider):  # descriptors made at import name the plugin
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
            with providing(info.provider):
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
        if self.has_plugin(info.name):
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
            if self.is_registered(plugin):
                self.unregister(plugin=plugin)
            error = PluginValidationError(f"{info.provider}: {exc}")
            error.__cause__ = exc
            self._record_broken(info, error)
            return
        self.infos.append(info)

    def warn_about_unknown_blocks(self) -> None:
        """Warn about block-list entries that name no plugin, distribution or module found."""
        known = [
            name
            for info in self.infos
            for name in (info.name, info.module, info.distribution)
            if name is not None
        ]
        normalised = {_normalize_dist(name) for name in known}
        for name in sorted(self._blocked):
            if name not in known and _normalize_dist(name) not in normalised:
                warnings.warn(
                    messages.unknown_block_entry(name, [i.name for i in self.infos]), PluginWarning, 3
                )

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
            + messages.fix_plugin(info.distribution, info.module, info.name)
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
                    problems.append("@hookimpl " + messages.not_a_hook(attribute, hook, hook_names))
            elif attribute in hook_names:
                problems.append(f"{attribute}() is not decorated with @verl_core.hookimpl")
            elif attribute.startswith(hookspecs.HOOK_PREFIX):
                problems.append(messages.not_a_hook(attribute, attribute, hook_names))
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

    ``autoload=None`` follows ``VERL_CORE_DISABLE_PLUGIN_AUTOLOAD``. Plugin failures are recorded in
    ``pm.infos``, never raised; an invalid environment switch raises ``SwitchError``.
    ``VERL_CORE_TRACE_HOOKS=1`` traces every hook call to stderr.
    """
    switches = Switches.read()
    pm = PluginManager(switches.autoload if autoload is None else autoload, switches.blocked)
    if switches.trace:
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    builtin = importlib.import_module(BUILTIN_MODULE)
    pm.add(builtin, PluginInfo(BUILTIN_PLUGIN, "verl-core", __version__, BUILTIN_MODULE))
    if pm.autoload:
        pm.load_entry_points()
    for module_name in switches.modules:
        pm.load_module(module_name)
    for plugin in plugins:
        if isinstance(plugin, str):
            pm.load_module(plugin)
        elif isinstance(plugin, types.ModuleType):
            pm.add(plugin, _explicit_plugin_info(plugin.__name__))
        else:  # a plugin object: a class or instance with hook methods
            name = getattr(plugin, "__name__", None) or type(plugin).__qualname__
            pm.add(plugin, PluginInfo(name, None, None, getattr(plugin, "__module__", None)))
    pm.warn_about_unknown_blocks()
    return pm
