"""The environment switches of plugin discovery, read in one place.

Every switch is documented in docs/plugins.md ("Environment switches"). They are read when plugins
are discovered, never at import. A boolean switch with a value that is not a boolean, and a block
list that names core itself, are errors naming the variable; a block list entry that names nothing
installed is a warning with the close match (a shared environment may block plugins that only some
machines have).
"""

from __future__ import annotations

import os

import attrs

from verl_core.errors import SwitchError

ENV_DISABLE_AUTOLOAD = "VERL_CORE_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "VERL_CORE_PLUGINS"
ENV_BLOCK = "VERL_CORE_BLOCK_PLUGINS"
ENV_TRACE = "VERL_CORE_TRACE_HOOKS"

#: Every switch and what it does, for ``verl-core plugins`` notes and the docs test.
SWITCHES: dict[str, str] = {
    ENV_DISABLE_AUTOLOAD: "do not load entry points (boolean)",
    ENV_PLUGINS: "comma-separated plugin modules to import explicitly",
    ENV_BLOCK: "comma-separated entry-point, distribution or module names never to import",
    ENV_TRACE: "print every hook call and its result to stderr (boolean)",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

#: Names under which core itself is known: its built-ins are part of core and cannot be blocked.
CORE_NAMES = ("verl_core", "verl-core", "verl_core._builtin")


def flag(variable: str) -> bool:
    """The boolean switch ``variable``; unset or empty is false. Raises ``SwitchError`` on other values."""
    value = os.environ.get(variable, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SwitchError(
        f"{variable}={os.environ[variable]!r} is not a boolean: set it to one of "
        f"{', '.join(_TRUE)} (on) or {', '.join(repr(v) for v in _FALSE[1:])} (off), or unset it"
    )


def names(variable: str) -> list[str]:
    """The comma-separated names in ``variable``, stripped, empty items dropped."""
    return [item.strip() for item in os.environ.get(variable, "").split(",") if item.strip()]


@attrs.frozen
class Switches:
    """The switches as discovery uses them, read once per discovery."""

    autoload: bool
    trace: bool
    modules: tuple[str, ...]
    blocked: tuple[str, ...]

    @classmethod
    def read(cls) -> Switches:
        blocked = tuple(names(ENV_BLOCK))
        core = [name for name in blocked if name in CORE_NAMES]
        if core:
            raise SwitchError(
                f"{ENV_BLOCK} names {', '.join(map(repr, core))}: core's built-ins are part of verl-core and "
                "cannot be blocked. Remove it from the list; to replace a built-in, give your plugin's "
                "descriptor override=True"
            )
        return cls(
            autoload=not flag(ENV_DISABLE_AUTOLOAD),
            trace=flag(ENV_TRACE),
            modules=tuple(names(ENV_PLUGINS)),
            blocked=blocked,
        )
