"""The registry built from in-memory plugin objects: attribution, resolution, validation errors.

Discovery through real entry points of fake distributions is in test_plugins_discovery.py.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_core import (
    ENGINE_API_VERSION,
    AdvantageEstimator,
    EngineBackend,
    PolicyLoss,
    __version__,
    hookimpl,
)
from verl_core.algos import catalog
from verl_core.deprecation import VerlCoreDeprecationWarning
from verl_core.errors import ApiVersionError, DuplicateNameError, PluginValidationError, UnknownNameError
from verl_core.plugins import Registry, get_registry
from verl_core.plugins.discovery import get_plugin_manager
from verl_core.plugins.messages import FIRST_PARTY
from verl_core.plugins.switches import ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_TRACE

KINDS = [
    "engine_backends",
    "advantage_estimators",
    "policy_losses",
    "rollout_backends",
    "reward_functions",
    "environments",
    "weight_transports",
    "metric_sinks",
]


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for variable in (ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_TRACE):
        monkeypatch.delenv(variable, raising=False)


def backend(name: str, **fields) -> EngineBackend:
    fields.setdefault("api_version", ENGINE_API_VERSION)
    return EngineBackend(
        name=name, engine="fixtures.engines:Engine", config="fixtures.engines:Config", **fields
    )


def make_plugin(plugin_name: str, **returns) -> type:
    """A plugin object named ``plugin_name`` whose hook ``verl_<kind>`` returns ``returns[kind]``."""

    def implementation(value):
        @hookimpl
        def hook():
            return value

        return staticmethod(hook)

    return type(plugin_name, (), {f"verl_{kind}": implementation(value) for kind, value in returns.items()})


def test_kinds_are_the_hooks_without_prefix_in_hookspec_order():
    assert Registry.from_plugins().kinds == KINDS


def test_core_builtins_are_an_ordinary_plugin():
    registry = Registry.from_plugins()
    (core,) = registry.plugins
    assert (core.name, core.distribution, core.module, core.status) == (
        "verl_core",
        "verl-core",
        "verl_core._builtin",
        "ok",
    )
    assert registry.names("advantage_estimators") == sorted(e.name for e in catalog.ADVANTAGE_ESTIMATORS)
    assert registry.names("policy_losses") == sorted(loss.name for loss in catalog.POLICY_LOSSES)
    for entry in registry.entries("advantage_estimators") + registry.entries("policy_losses"):
        assert (entry.plugin, entry.distribution, entry.status) == ("verl_core", "verl-core", "ok")


def test_descriptors_are_attributed_to_the_plugin_that_returned_them():
    alpha = make_plugin("alpha", engine_backends=[backend("a1"), backend("a2")])
    beta = make_plugin(
        "beta", engine_backends=(backend("b1"),), advantage_estimators=[AdvantageEstimator("b_adv", len)]
    )
    registry = Registry.from_plugins([alpha, beta])
    assert registry.names("engine_backends") == ["a1", "a2", "b1"]
    assert [(e.name, e.plugin, e.status) for e in registry.entries("engine_backends")] == [
        ("a1", "alpha", "ok"),
        ("a2", "alpha", "ok"),
        ("b1", "beta", "ok"),
    ]
    assert registry.get("engine_backends", "b1") == backend("b1")
    assert registry.entry("engine_backends", "b1").provider == "plugin 'beta' (no distribution)"
    assert registry.get("advantage_estimators", "b_adv").load() is len


def test_unknown_name_lists_installed_names_and_suggests_the_close_match():
    registry = Registry.from_plugins(
        [make_plugin("alpha", engine_backends=[backend("ddp"), backend("veomni")])]
    )
    with pytest.raises(UnknownNameError) as caught:
        registry.get("engine_backends", "veomini", where="actor.engine.backend")
    message = str(caught.value)
    assert "Unknown engine backend 'veomini' (from actor.engine.backend)" in message
    assert "Installed engine backends: ddp (no distribution), veomni (no distribution)" in message
    assert "(did you mean 'veomni'?)" in message
    assert caught.value.__cause__ is None  # no broken plugin to blame


def test_unknown_kind_names_the_kinds():
    with pytest.raises(UnknownNameError, match="Unknown registry kind 'engines'.*engine_backends"):
        Registry.from_plugins().names("engines")


@pytest.mark.parametrize(
    ("name", "distribution", "extra"),
    [("fsdp", "verl-fsdp-plugin", "fsdp"), ("megatron", "verl-megatron-plugin", "megatron")],
)
def test_unknown_first_party_backend_names_its_distribution(name, distribution, extra):
    with pytest.raises(UnknownNameError) as caught:
        Registry.from_plugins(autoload=False).get("engine_backends", name)
    try:  # the branch depends on this environment; the fake distributions test both deterministically
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        expected = f"The '{name}' engine backend ships in {distribution}: pip install \"verl-core[{extra}]\""
    else:
        expected = (
            f"{distribution} {version} is installed but provides no '{name}' engine backend: plugin autoload "
            f"is disabled ({ENV_DISABLE_AUTOLOAD}=1); list its module in {ENV_PLUGINS}."
        )
    assert expected in str(caught.value)


def test_misspelled_first_party_backend_suggests_it_with_its_pip_extra(monkeypatch):
    monkeypatch.setitem(FIRST_PARTY, "engine_backends", {"tpu": ("verl-tpu-plugin-not-installed", "tpu")})
    with pytest.raises(UnknownNameError) as caught:
        Registry.from_plugins().get("engine_backends", "tpuu", where="actor.engine.backend")
    message = str(caught.value)
    assert "Unknown engine backend 'tpuu' (from actor.engine.backend)" in message
    assert "(did you mean 'tpu'?)" in message
    assert (
        "The 'tpu' engine backend ships in verl-tpu-plugin-not-installed: pip install \"verl-core[tpu]\""
        in message
    )


def test_unknown_first_party_backend_that_is_not_installed_gives_the_pip_extra(monkeypatch):
    monkeypatch.setitem(FIRST_PARTY, "engine_backends", {"tpu": ("verl-tpu-plugin-not-installed", "tpu")})
    with pytest.raises(UnknownNameError) as caught:
        Registry.from_plugins().get("engine_backends", "tpu")
    assert (
        "The 'tpu' engine backend ships in verl-tpu-plugin-not-installed: pip install \"verl-core[tpu]\""
        in str(caught.value)
    )


@pytest.mark.parametrize(
    ("returned", "got"),
    [
        ({"name": "x"}, "got dict {'name': 'x'}"),
        (None, "got NoneType None"),
        ([backend("fine"), "ddp"], "got item 1 is str 'ddp'"),
        ([PolicyLoss("wrong_kind", len)], "got item 0 is PolicyLoss"),
    ],
)
def test_wrong_return_type_breaks_only_that_plugin(returned, got):
    registry = Registry.from_plugins(
        [make_plugin("bad", engine_backends=returned), make_plugin("good", engine_backends=[backend("ddp")])]
    )
    bad = next(info for info in registry.plugins if info.name == "bad")
    assert bad.status == "broken"
    assert isinstance(bad.exception, PluginValidationError)
    assert (
        "plugin 'bad' (no distribution): hook verl_engine_backends() must return a list of EngineBackend"
        in (bad.error)
    )
    assert got in bad.error
    assert "fine" not in registry.names("engine_backends")  # nothing of a broken plugin is used
    assert registry.get("engine_backends", "ddp") == backend("ddp")
    with pytest.raises(UnknownNameError) as caught:
        registry.get("engine_backends", "fine")
    assert (
        "Note: a broken plugin might provide it: plugin 'bad' (no distribution): hook verl_engine_backends()"
        in str(caught.value)
    )
    assert caught.value.__cause__ is bad.exception


def test_hook_that_raises_breaks_only_that_plugin():
    class Raising:
        @staticmethod
        @hookimpl
        def verl_engine_backends():
            raise KeyError("missing setting")

    registry = Registry.from_plugins([Raising, make_plugin("good", engine_backends=[backend("ddp")])])
    raising = next(info for info in registry.plugins if info.name == "Raising")
    assert raising.status == "broken"
    assert "hook verl_engine_backends() raised KeyError: 'missing setting'" in raising.error
    assert isinstance(raising.exception.__cause__, KeyError)
    assert registry.names("engine_backends") == ["ddp"]


def test_misspelled_hook_implementation_is_broken_with_a_suggestion():
    class Misspelled:
        @staticmethod
        @hookimpl
        def verl_engine_backend():
            return [backend("ddp")]

    class Unmarked:
        @staticmethod
        def verl_engine_backends():
            return [backend("ddp")]

    class UnknownUnmarked:
        verl_core = sys.modules["verl_core"]  # modules and plain values named verl_* are not hooks

        @staticmethod
        def verl_engine_backendz():
            return []

    registry = Registry.from_plugins([Misspelled, Unmarked, UnknownUnmarked])
    errors = {info.name: info.error for info in registry.plugins if info.status == "broken"}
    assert errors.keys() == {"Misspelled", "Unmarked", "UnknownUnmarked"}
    assert (
        "@hookimpl verl_engine_backend() is not a verl-core hook (did you mean 'verl_engine_backends'?)"
        in (errors["Misspelled"])
    )
    assert "verl_engine_backends() is not decorated with @verl_core.hookimpl" in errors["Unmarked"]
    assert errors["UnknownUnmarked"].endswith(
        "verl_engine_backendz() is not a verl-core hook (did you mean 'verl_engine_backends'?)"
    )


def test_hookimpl_with_arguments_the_spec_lacks_is_broken():
    class Greedy:
        @staticmethod
        @hookimpl
        def verl_engine_backends(config):
            return []

    (_, greedy) = Registry.from_plugins([Greedy]).plugins
    assert greedy.status == "broken"
    assert "plugin 'Greedy' (no distribution)" in greedy.error
    assert "config" in greedy.error


@pytest.mark.parametrize(
    ("api_version", "upgrade"),
    [
        (ENGINE_API_VERSION - 1, "Upgrade plugin 'old' so that"),
        (ENGINE_API_VERSION + 1, "Upgrade verl-core (pip install -U verl-core) so that"),
    ],
)
def test_api_version_mismatch_names_both_versions_and_what_to_upgrade(api_version, upgrade):
    registry = Registry.from_plugins(
        [make_plugin("old", engine_backends=[backend("ddp", api_version=api_version)])]
    )
    (entry,) = registry.entries("engine_backends")
    assert entry.status == "incompatible"
    with pytest.raises(ApiVersionError) as caught:
        registry.get("engine_backends", "ddp")
    message = str(caught.value)
    assert (
        f"engine backend 'ddp' from plugin 'old' (no distribution) targets engine API version {api_version}"
        in message
    )
    assert f"verl-core {__version__} speaks engine API version {ENGINE_API_VERSION}" in message
    assert upgrade in message


# Resolution of one name provided by several plugins, against the rule written out:
# one provider, or exactly one override=True, wins; the winner must speak the engine API version.
providers = st.lists(
    st.tuples(st.booleans(), st.sampled_from([ENGINE_API_VERSION, ENGINE_API_VERSION + 1])),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(providers)
def test_resolution_of_one_name_by_several_plugins(provided):
    plugins = [
        make_plugin(
            f"p{i}", engine_backends=[backend("ddp", override=override, api_version=api, description=f"p{i}")]
        )
        for i, (override, api) in enumerate(provided)
    ]
    registry = Registry.from_plugins(plugins)
    overriding = [i for i, (override, _) in enumerate(provided) if override]
    statuses = [entry.status for entry in registry.entries("engine_backends")]
    if len(provided) > 1 and len(overriding) != 1:
        assert statuses == ["conflict"] * len(provided)
        with pytest.raises(DuplicateNameError) as caught:
            registry.get("engine_backends", "ddp")
        for i in range(len(provided)):
            assert f"plugin 'p{i}'" in str(caught.value)
        assert "override=True" in str(caught.value) and ENV_BLOCK in str(caught.value)
        return
    winner = overriding[0] if overriding else 0
    expected = ["overridden"] * len(provided)
    expected[winner] = "ok" if provided[winner][1] == ENGINE_API_VERSION else "incompatible"
    assert statuses == expected
    if expected[winner] == "ok":
        assert registry.get("engine_backends", "ddp").description == f"p{winner}"
    else:
        with pytest.raises(ApiVersionError, match=f"plugin 'p{winner}'"):
            registry.get("engine_backends", "ddp")


def test_overriding_a_builtin_needs_override_true():
    if not catalog.ADVANTAGE_ESTIMATORS:
        pytest.skip("core ships no advantage estimator yet")
    builtin = catalog.ADVANTAGE_ESTIMATORS[0]
    silent = make_plugin("silent", advantage_estimators=[AdvantageEstimator(builtin.name, len)])
    with pytest.raises(
        DuplicateNameError,
        match=rf"plugin 'verl_core' \(verl-core {re.escape(__version__)}\) and plugin 'silent'",
    ):
        Registry.from_plugins([silent]).get("advantage_estimators", builtin.name)
    explicit = make_plugin(
        "explicit", advantage_estimators=[AdvantageEstimator(builtin.name, len, override=True)]
    )
    registry = Registry.from_plugins([explicit])
    assert registry.get("advantage_estimators", builtin.name).load() is len
    core_entry = next(
        e
        for e in registry.entries("advantage_estimators")
        if e.name == builtin.name and e.plugin == "verl_core"
    )
    assert (
        core_entry.status == "overridden"
        and core_entry.error == "overridden by plugin 'explicit' (no distribution)"
    )


def test_plugin_manager_has_no_import_time_side_effects_and_traces_on_request(monkeypatch, capsys):
    plugin = make_plugin("traced", engine_backends=[backend("ddp")])
    Registry(get_plugin_manager(autoload=False, plugins=[plugin]))
    assert "verl_engine_backends" not in capsys.readouterr().err
    monkeypatch.setenv(ENV_TRACE, "1")
    Registry(get_plugin_manager(autoload=False, plugins=[plugin]))
    assert "verl_engine_backends" in capsys.readouterr().err


def test_get_registry_is_cached_until_refreshed():
    first = get_registry()
    assert get_registry() is first
    assert get_registry(refresh=True) is not first


def test_two_override_claims_get_a_fix_that_can_work():
    plugins = [make_plugin(f"p{i}", engine_backends=[backend("ddp", override=True)]) for i in range(2)]
    with pytest.raises(DuplicateNameError) as caught:
        Registry.from_plugins(plugins).get("engine_backends", "ddp")
    message = str(caught.value)
    assert (
        "2 of them mark override=True (plugin 'p0' (no distribution), plugin 'p1' (no distribution))"
        in message
    )
    assert "remove override=True from all but the EngineBackend that should win" in message
    assert "set override=True on" not in message


def test_kind_constants_are_the_registry_kinds():
    from verl_core import hookspecs

    constants = [hookspecs.ENGINE_BACKENDS, hookspecs.ADVANTAGE_ESTIMATORS, hookspecs.POLICY_LOSSES]
    constants += [hookspecs.ROLLOUT_BACKENDS, hookspecs.REWARD_FUNCTIONS, hookspecs.ENVIRONMENTS]
    constants += [hookspecs.WEIGHT_TRANSPORTS, hookspecs.METRIC_SINKS]
    assert constants == Registry.from_plugins().kinds


def test_a_backend_without_api_version_reads_as_1_with_a_deprecation_warning():
    """verl-core 0.1.0 filled api_version in; since 0.2.0 a literal is expected, and its absence warns."""
    with pytest.warns(VerlCoreDeprecationWarning) as caught:
        unstated = EngineBackend(
            name="mine", engine="fixtures.engines:Engine", config="fixtures.engines:Config"
        )
    assert unstated.api_version == 1
    message = str(caught[0].message)
    assert "EngineBackend without api_version is deprecated since verl-core 0.2.0" in message
    assert "api_version=1" in message and "as a literal number (not verl_core.ENGINE_API_VERSION" in message
    with pytest.raises(TypeError, match=r"api_version='1': expected an int"):
        backend("mine", api_version="1")


def test_a_plugin_whose_descriptor_lacks_the_api_version_still_registers():
    class Unversioned:
        @staticmethod
        @hookimpl
        def verl_engine_backends():
            return [
                EngineBackend(name="mine", engine="fixtures.engines:Engine", config="fixtures.engines:Config")
            ]

    with pytest.warns(VerlCoreDeprecationWarning, match="EngineBackend without api_version"):
        registry = Registry.from_plugins([Unversioned])
    assert registry.entry("engine_backends", "mine").status == "ok"
