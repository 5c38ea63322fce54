"""How plugin problems are worded: who provides what, close matches, and the fix for each failure.

Every message names the plugin and its distribution (``plugin 'ddp' (verl-ddp 0.1.0)``) and says
what to do; the registry and discovery only decide *when* to raise or record them.
"""

from __future__ import annotations

import importlib.metadata as metadata

from verl_core import __version__
from verl_core.descriptors import (
    ENGINE_API_VERSION,
    MIN_ENGINE_API_VERSION,
    MIN_ROLLOUT_API_VERSION,
    ROLLOUT_API_VERSION,
)
from verl_core.errors import did_you_mean
from verl_core.hookspecs import ENTRY_POINT_GROUP, Kind
from verl_core.plugins.switches import ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS

#: First-party names shipped in separate distributions: kind -> name -> (distribution, pip extra).
FIRST_PARTY: dict[str, dict[str, tuple[str, str]]] = {
    Kind.ENGINE_BACKENDS: {
        "fsdp": ("verl-fsdp-plugin", "fsdp"),
        "megatron": ("verl-megatron-plugin", "megatron"),
    },
    Kind.ROLLOUT_BACKENDS: {"vllm": ("verl-vllm-plugin", "vllm")},
}


def dist_label(distribution: str | None, version: str | None) -> str:
    """``verl-ddp 0.1.0``, or ``no distribution`` for a module loaded by name."""
    if distribution is None:
        return "no distribution"
    return f"{distribution} {version}" if version else distribution


def provider(plugin: str, distribution: str | None, version: str | None) -> str:
    """``plugin 'ddp' (verl-ddp 0.1.0)``: how messages name a plugin."""
    return f"plugin '{plugin}' ({dist_label(distribution, version)})"


def short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fix_plugin(distribution: str | None, module: str | None, plugin: str) -> str:
    """The usual way out of a broken plugin."""
    return f"Fix or upgrade {distribution or module or 'the module'}, or block it with {ENV_BLOCK}={plugin}"


def not_a_hook(attribute: str, hook: str, hook_names: list[str]) -> str:
    advice = did_you_mean(hook, hook_names) or f" (the hooks are {', '.join(hook_names)})"
    return f"{attribute}() is not a verl-core hook{advice}"


def conflict(
    label: str, descriptor_class: str, name: str, providers: list[str], overriding: list[str]
) -> str:
    """Several providers of one name and not exactly one ``override=True`` among them."""
    listed = " and ".join(providers)
    if overriding:
        return (
            f"{label} '{name}' is provided by {listed}, and {len(overriding)} of them mark override=True "
            f"({', '.join(overriding)}); only one may win. Fix: remove override=True from all but the "
            f"{descriptor_class} that should win, uninstall one distribution, or block one plugin with "
            f"{ENV_BLOCK}=<plugin or distribution>."
        )
    return (
        f"{label} '{name}' is provided by {listed}: none of them marks override=True. Fix: set "
        f"override=True on the {descriptor_class} that should win, uninstall one distribution, or block one "
        f"plugin with {ENV_BLOCK}=<plugin or distribution>."
    )


#: The contracts with a version, by the kind of descriptor that states it: (name, oldest accepted, newest).
API_VERSIONS: dict[str, tuple[str, int, int]] = {
    Kind.ENGINE_BACKENDS: ("engine", MIN_ENGINE_API_VERSION, ENGINE_API_VERSION),
    Kind.ROLLOUT_BACKENDS: ("rollout", MIN_ROLLOUT_API_VERSION, ROLLOUT_API_VERSION),
}


def api_mismatch(
    label: str, name: str, by: str, distribution: str | None, plugin: str, version: int, kind: str
) -> str:
    contract, _, newest = API_VERSIONS[kind]
    if version > newest:
        upgrade = "Upgrade verl-core (pip install -U verl-core)"
    elif distribution:
        upgrade = f"Upgrade {distribution} (pip install -U {distribution})"
    else:
        upgrade = f"Upgrade plugin '{plugin}'"
    return (
        f"{label} '{name}' from {by} targets {contract} API version {version}, "
        f"but verl-core {__version__} speaks {spoken_api_versions(kind)}. "
        f"{upgrade} so that both speak the same version."
    )


def spoken_api_versions(kind: str | None = None) -> str:
    """``engine API version 2`` or ``engine API versions 1 to 2``: what this core accepts of the contract
    of ``kind``; of every versioned contract, comma-separated, when ``kind`` is ``None``."""
    if kind is None:
        return ", ".join(spoken_api_versions(each) for each in API_VERSIONS)
    contract, oldest, newest = API_VERSIONS[kind]
    if oldest == newest:
        return f"{contract} API version {newest}"
    return f"{contract} API versions {oldest} to {newest}"


def unimportable(label: str, name: str, by: str, field: str, target: str, cause: str) -> str:
    """An import string of a descriptor that does not resolve."""
    return (
        f"{label} '{name}' from {by}: its {field} {target!r} cannot be imported ({cause}). Fix the "
        f"descriptor's {field}= import string ('package.module:attribute') in the plugin, or reinstall it"
    )


def unavailable(label: str, name: str, by: str, module: str, install: str) -> str:
    """A backend whose ``requires`` names a module that is not installed."""
    fix = install or f"install the package that provides the module '{module}'"
    return f"{label} '{name}' from {by} needs the module '{module}', which is not installed. Fix: {fix}"


def first_party_hint(
    label: str, name: str, distribution: str, extra: str, loaded: list, autoload: bool
) -> str:
    """What to do about a first-party name that is not provided: install it, or why it is missing.

    ``loaded`` are the plugins discovery found from ``distribution`` (their ``status``)."""
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return f"The '{name}' {label} ships in {distribution}: pip install \"verl-core[{extra}]\""
    hint = f"{distribution} {version} is installed but provides no '{name}' {label}"
    if not loaded and not autoload:
        return f"{hint}: plugin autoload is disabled ({ENV_DISABLE_AUTOLOAD}=1); list its module in {ENV_PLUGINS}."
    if any(info.status != "ok" for info in loaded):
        return f"{hint}: its plugin is not loaded (see the note below)."
    if not loaded:
        return (
            f"{hint}: this release declares no '{ENTRY_POINT_GROUP}' entry point, so it "
            f"provides no plugins at all. Install a release of {distribution} that provides '{name}' "
            f'(its release notes say which) with pip install -U "verl-core[{extra}]"'
        )
    return f'{hint}; reinstall a matching release: pip install --force-reinstall "verl-core[{extra}]"'


def unknown_block_entry(name: str, known: list[str]) -> str:
    return (
        f"{ENV_BLOCK} names '{name}', which is no installed plugin, distribution or module"
        f"{did_you_mean(name, known)}; "
        f"the installed plugins are {', '.join(sorted(set(known))) or 'none'}. Fix the name or remove it"
    )
