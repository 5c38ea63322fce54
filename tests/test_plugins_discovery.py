"""Discovery through entry points of fake installed distributions, and the environment switches."""

from __future__ import annotations

import sys

import pytest
from fixtures.fake_dist import backends_plugin, fake_distributions

from verl_core.errors import DuplicateNameError, PluginLoadError, PluginWarning, SwitchError, UnknownNameError
from verl_core.plugins import PluginInfo, Registry
from verl_core.plugins.switches import ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_TRACE

RAISES_ON_IMPORT = "raise RuntimeError('boom: missing dependency')"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for variable in (ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_TRACE):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def dists(tmp_path):
    with fake_distributions(tmp_path) as installed:
        yield installed


def plugin_info(registry: Registry, name: str) -> PluginInfo:
    return next(info for info in registry.plugins if info.name == name)


def test_entry_points_are_discovered_with_their_distribution(dists):
    dists.add("verl-fake-ddp", "0.3", {"fakeddp": backends_plugin("fakeddp")})
    registry = Registry.from_plugins(autoload=True)
    assert plugin_info(registry, "fakeddp") == PluginInfo(
        "fakeddp", "verl-fake-ddp", "0.3", "fakeddp_plugin", "ok", None
    )
    entry = registry.entry("engine_backends", "fakeddp")
    assert (entry.plugin, entry.distribution, entry.version) == ("fakeddp", "verl-fake-ddp", "0.3")
    assert "fakeddp" not in Registry.from_plugins(autoload=False).names("engine_backends")


def test_plugin_that_raises_on_import_is_broken_and_the_others_work(dists):
    dists.add("broken-dist", "1.2", {"broken": RAISES_ON_IMPORT})
    dists.add("good-dist", "0.1", {"good": backends_plugin("good")})
    registry = Registry.from_plugins(autoload=True)

    broken = plugin_info(registry, "broken")
    assert (broken.distribution, broken.version, broken.status) == ("broken-dist", "1.2", "broken")
    assert "plugin 'broken' (broken-dist 1.2) failed to import 'broken_plugin'" in broken.error
    assert "RuntimeError: boom: missing dependency" in broken.error
    assert f"block it with {ENV_BLOCK}=broken" in broken.error
    assert registry.get("engine_backends", "good").name == "good"

    with pytest.raises(UnknownNameError) as caught:
        registry.get("engine_backends", "goo")
    message = str(caught.value)
    assert "(did you mean 'good'?)" in message
    assert (
        "Note: a broken plugin might provide it: plugin 'broken' (broken-dist 1.2) failed to import"
        in message
    )
    assert isinstance(caught.value.__cause__, PluginLoadError)
    assert isinstance(caught.value.__cause__.__cause__, RuntimeError)


def test_two_distributions_claiming_one_name_conflict_until_one_is_blocked(dists, monkeypatch):
    dists.add("dist-a", "0.1", {"plug_a": backends_plugin("fakeddp")})
    dists.add("dist-b", "2.0", {"plug_b": backends_plugin("fakeddp")})
    registry = Registry.from_plugins(autoload=True)
    assert [
        (e.distribution, e.status) for e in registry.entries("engine_backends") if e.name == "fakeddp"
    ] == [
        ("dist-a", "conflict"),
        ("dist-b", "conflict"),
    ]
    with pytest.raises(DuplicateNameError) as caught:
        registry.get("engine_backends", "fakeddp")
    message = str(caught.value)
    assert (
        "engine backend 'fakeddp' is provided by plugin 'plug_a' (dist-a 0.1) and plugin 'plug_b' (dist-b 2.0)"
        in (message)
    )
    assert "set override=True on the EngineBackend that should win, uninstall one distribution" in message
    assert f"{ENV_BLOCK}=<plugin or distribution>" in message

    monkeypatch.setenv(ENV_BLOCK, "Dist_B")  # distribution names compare normalised
    sys.modules.pop("plug_b_plugin", None)
    registry = Registry.from_plugins(autoload=True)
    assert registry.entry("engine_backends", "fakeddp").distribution == "dist-a"
    assert plugin_info(registry, "plug_b").status == "blocked"
    assert "plug_b_plugin" not in sys.modules


def test_blocked_plugin_is_never_imported(dists, monkeypatch):
    dists.add("explosive-dist", "0.1", {"explosive": RAISES_ON_IMPORT})
    dists.add("other-dist", "0.1", {"other": RAISES_ON_IMPORT})
    monkeypatch.setenv(ENV_BLOCK, "explosive,other_plugin ")  # entry-point or module names
    registry = Registry.from_plugins(autoload=True)
    info = plugin_info(registry, "explosive")
    assert (info.status, info.error, info.distribution) == (
        "blocked",
        f"blocked by {ENV_BLOCK}",
        "explosive-dist",
    )
    assert plugin_info(registry, "other").status == "blocked"
    assert "explosive_plugin" not in sys.modules and "other_plugin" not in sys.modules
    with pytest.raises(UnknownNameError) as caught:
        registry.get("engine_backends", "explosive")
    assert (
        f"Note: a blocked plugin might provide it: plugin 'explosive' (explosive-dist 0.1) is blocked by {ENV_BLOCK}"
        in str(caught.value)
    )


def test_disabled_autoload_loads_only_the_modules_named_in_the_environment(dists, monkeypatch):
    dists.add("dist-a", "0.1", {"plug_a": backends_plugin("a")})
    dists.add("dist-b", "0.1", {"plug_b": backends_plugin("b")})
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    registry = Registry.from_plugins(autoload=None)
    assert {"plug_a", "plug_b"}.isdisjoint(info.name for info in registry.plugins)

    monkeypatch.setenv(ENV_PLUGINS, "plug_b_plugin")
    registry = Registry.from_plugins(autoload=None)
    # The module keeps the name and distribution of the entry point that names it.
    assert plugin_info(registry, "plug_b").distribution == "dist-b"
    assert "plug_a" not in [info.name for info in registry.plugins]
    assert registry.names("engine_backends") == ["b"]

    monkeypatch.delenv(ENV_DISABLE_AUTOLOAD)  # with autoload too, the module is registered once
    registry = Registry.from_plugins(autoload=None)
    assert [info.name for info in registry.plugins].count("plug_b") == 1


def test_unimportable_module_named_in_the_environment_is_broken(monkeypatch):
    monkeypatch.setenv(ENV_PLUGINS, "no_such_plugin_module")
    info = plugin_info(Registry.from_plugins(), "no_such_plugin_module")
    assert info.status == "broken"
    assert "failed to import 'no_such_plugin_module': ModuleNotFoundError" in info.error


def test_two_entry_points_with_one_name_break_the_second(dists):
    dists.add("dist-a", "0.1", {"same": backends_plugin("a")})
    dists.add("dist-z", "0.1", {"same": ("other_same", backends_plugin("b"))})
    registry = Registry.from_plugins(autoload=True)
    same = [info for info in registry.plugins if info.name == "same"]
    assert [info.status for info in same] == ["ok", "broken"]
    assert "the plugin name 'same' is already used by plugin 'same' (dist-a 0.1)" in same[1].error
    assert "a" in registry.names("engine_backends") and "b" not in registry.names("engine_backends")


def test_first_party_distribution_installed_without_the_backend(dists):
    dists.add("verl-fsdp-plugin", "9.9", {"fsdp": backends_plugin("fsdp2")})
    dists.add("verl-megatron-plugin", "9.9", {"megatron": RAISES_ON_IMPORT})
    registry = Registry.from_plugins(autoload=True)
    with pytest.raises(UnknownNameError) as caught:
        registry.get("engine_backends", "fsdp")
    assert (
        "verl-fsdp-plugin 9.9 is installed but provides no 'fsdp' engine backend; reinstall a matching release: "
        'pip install --force-reinstall "verl-core[fsdp]"' in str(caught.value)
    )
    with pytest.raises(UnknownNameError) as caught:
        registry.get("engine_backends", "megatron")
    message = str(caught.value)
    assert (
        "verl-megatron-plugin 9.9 is installed but provides no 'megatron' engine backend: its plugin is not loaded"
        in (message)
    )
    assert "Note: a broken plugin might provide it: plugin 'megatron' (verl-megatron-plugin 9.9)" in message


def test_first_party_distribution_without_an_entry_point_asks_for_an_upgrade(dists):
    dists.add("verl-megatron-plugin", "9.9", {})  # an early release that registers no backend yet
    with pytest.raises(UnknownNameError) as caught:
        Registry.from_plugins(autoload=True).get("engine_backends", "megatron")
    assert (
        "verl-megatron-plugin 9.9 is installed but provides no 'megatron' engine backend: this release declares "
        "no 'verl_core.plugins' entry point, so it provides no plugins at all. Install a release of "
        "verl-megatron-plugin that provides 'megatron' (its release notes say which) with "
        'pip install -U "verl-core[megatron]"' in str(caught.value)
    )


# -- the environment switches: wrong values are named, never silently ignored ----------------------


@pytest.mark.parametrize("variable", [ENV_DISABLE_AUTOLOAD, ENV_TRACE])
def test_a_boolean_switch_with_another_value_is_an_error_naming_it(variable, monkeypatch):
    monkeypatch.setenv(variable, "enabled")
    with pytest.raises(SwitchError) as caught:
        Registry.from_plugins(autoload=None)
    message = str(caught.value)
    assert f"{variable}='enabled' is not a boolean" in message
    assert "1, true, yes, on" in message and "'0', 'false', 'no', 'off'" in message


@pytest.mark.parametrize("value", ["0", "false", "OFF", "", " no "])
def test_false_values_keep_autoload_on(value, dists, monkeypatch):
    dists.add("dist-a", "0.1", {"plug_a": backends_plugin("a")})
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, value)
    assert "a" in Registry.from_plugins(autoload=None).names("engine_backends")


@pytest.mark.parametrize("core", ["verl_core", "verl-core"])
def test_blocking_core_itself_is_an_error(core, monkeypatch):
    monkeypatch.setenv(ENV_BLOCK, f"ddp,{core}")
    with pytest.raises(SwitchError, match=f"{ENV_BLOCK} names '{core}': core's built-ins .* override=True"):
        Registry.from_plugins()


def test_a_block_entry_that_names_nothing_installed_warns_with_the_close_match(dists, monkeypatch):
    dists.add("verl-fake-ddp", "0.3", {"fakeddp": backends_plugin("fakeddp")})
    monkeypatch.setenv(ENV_BLOCK, "fakedp")
    with pytest.warns(PluginWarning) as caught:
        registry = Registry.from_plugins(autoload=True)
    (warning,) = [str(w.message) for w in caught]
    assert f"{ENV_BLOCK} names 'fakedp', which is no installed plugin, distribution or module" in warning
    assert "(did you mean 'fakeddp'?)" in warning
    assert plugin_info(registry, "fakeddp").status == "ok"  # nothing was blocked


def test_block_entries_by_distribution_or_module_do_not_warn(dists, monkeypatch, recwarn):
    dists.add("Verl_Fake-DDP", "0.3", {"fakeddp": backends_plugin("fakeddp")})
    dists.add("other-dist", "0.1", {"other": backends_plugin("other")})
    monkeypatch.setenv(ENV_BLOCK, "verl-fake-ddp,other_plugin")
    registry = Registry.from_plugins(autoload=True)
    assert {plugin_info(registry, n).status for n in ("fakeddp", "other")} == {"blocked"}
    assert not [w for w in recwarn if issubclass(w.category, PluginWarning)]


# -- import strings that name nothing: broken in the listing, attributed when loaded ---------------


def test_a_backend_whose_engine_module_does_not_exist_is_broken_in_the_listing(dists):
    dists.add(
        "typo-dist",
        "0.2",
        {"typo": backends_plugin("typo").replace("fake_engines:Engine", "fake_engins:Engine")},
    )
    registry = Registry.from_plugins(autoload=True)
    (entry,) = [e for e in registry.entries("engine_backends") if e.name == "typo"]
    assert entry.status == "broken"
    assert entry.error == (
        "engine backend 'typo' from plugin 'typo' (typo-dist 0.2): its engine 'fake_engins:Engine' cannot be "
        "imported (no module named 'fake_engins'). Fix the descriptor's engine= import string "
        "('package.module:attribute') in the plugin, or reinstall it"
    )
    with pytest.raises(PluginLoadError, match="engine backend 'typo' from plugin 'typo'"):
        registry.get("engine_backends", "typo")


def test_a_wrong_attribute_is_named_with_the_plugin_when_loaded(dists):
    dists.add(
        "attr-dist",
        "0.2",
        {"attr": backends_plugin("attr").replace("fake_engines:Engine", "fake_engines:Engin")},
    )
    entry = Registry.from_plugins(autoload=True).entry("engine_backends", "attr")
    assert entry.status == "ok"  # the module exists; attributes are checked when loaded
    with pytest.raises(PluginLoadError) as caught:
        entry.load("engine")
    assert str(caught.value).startswith(
        "engine backend 'attr' from plugin 'attr' (attr-dist 0.2): its engine 'fake_engines:Engin' cannot be "
        "imported (AttributeError: module 'fake_engines' has no attribute 'Engin')"
    )
    assert isinstance(caught.value.__cause__, AttributeError)


UNVERSIONED_AT_IMPORT = """
    from verl_core import EngineBackend, hookimpl

    BACKENDS = [EngineBackend(name="early", engine="fake_engines:Engine", config="fake_engines:Config")]

    @hookimpl
    def verl_engine_backends():
        return BACKENDS
"""


def test_the_missing_api_version_warning_names_the_plugin_and_its_distribution(dists):
    """On main it said only "EngineBackend without api_version is deprecated": with several plugins
    installed, nothing said whose. Descriptors made in the hook and at the module's import are named."""
    from verl_core.deprecation import VerlCoreDeprecationWarning

    dists.add("old-vendor", "0.1.4", {"old": backends_plugin("late", api_version=None)})
    dists.add("older-vendor", "0.0.9", {"older": UNVERSIONED_AT_IMPORT})
    with pytest.warns(VerlCoreDeprecationWarning) as caught:
        registry = Registry.from_plugins(autoload=True)
    messages = {
        (warning.filename.rpartition("/")[2], str(warning.message).partition(": ")[0]) for warning in caught
    }
    # Each at the plugin's own line, as before.
    assert messages == {
        ("old_plugin.py", "plugin 'old' (old-vendor 0.1.4), engine backend 'late'"),
        ("older_plugin.py", "plugin 'older' (older-vendor 0.0.9), engine backend 'early'"),
    }
    assert all("EngineBackend without api_version is deprecated" in str(w.message) for w in caught)
    assert registry.entry("engine_backends", "late").status == "ok"
