"""Plugins: discovery, the registry of what they provide, and the errors that name them.

``get_registry()`` is the process-wide registry of the installed plugins, looked up by ``Kind``;
``Registry.from_plugins`` builds one from given plugin modules or objects (tests). Discovery (``discovery``): core's internal
plugin ``verl_core._builtin``, then every entry point of the group ``verl_core.plugins``, then the
modules named in ``VERL_CORE_PLUGINS``, then plugin objects passed in. The environment switches live
in ``switches``, the wording of every failure in ``messages``, the rows ``verl-core plugins``
prints in ``table``.

Nothing here imports torch or a backend; plugin modules are expected to stay light too.
"""

from verl_core.deprecation import moved_names
from verl_core.hookspecs import Kind
from verl_core.plugins.discovery import PluginInfo, PluginStatus
from verl_core.plugins.registry import Entry, EntryStatus, Registry, get_registry

__all__ = [
    "Entry",
    "EntryStatus",
    "Kind",
    "PluginInfo",
    "PluginStatus",
    "Registry",
    "get_registry",
]

__getattr__ = moved_names(
    __name__, {"HOOK_PREFIX": "verl_core.hookspecs:HOOK_PREFIX"}, since="0.2.0", removed_in="0.4.0"
)
