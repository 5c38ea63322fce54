"""``build_engine``: backend lookup, role/device/options checks whose errors name the plugin and the fix.

The engines are the real DDP engine of ``plugins/verl_ddp`` (installed editable), described by test
plugins with narrower roles and devices.
"""

from __future__ import annotations

import re

import pytest

from verl_core import EngineBackend, hookimpl
from verl_core.config.engine import EngineConfig, ModelConfig
from verl_core.engine import BaseEngine, build_engine
from verl_core.errors import ConfigError, PluginValidationError, UnknownNameError
from verl_core.plugins import Registry

pytest.importorskip("verl_ddp", reason="needs the template plugin: pip install -e plugins/verl_ddp")
from verl_ddp.config import DDPConfig  # noqa: E402
from verl_ddp.engine import DDPEngine  # noqa: E402


class NarrowPlugin:
    """Backends that support less than the DDP engine could, to exercise the refusals."""

    @hookimpl
    def verl_engine_backends(self) -> list[EngineBackend]:
        return [
            EngineBackend(
                name="lm-on-cuda",
                engine="verl_ddp.engine:DDPEngine",
                config="verl_ddp.config:DDPConfig",
                roles=("lm",),
                devices=("cuda",),
                api_version=1,
            ),
            EngineBackend(
                name="not-an-engine",
                engine="verl_ddp.config:DDPConfig",
                config="verl_ddp.config:DDPConfig",
                api_version=1,
            ),
        ]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_plugins(["verl_ddp.plugin", NarrowPlugin()], autoload=False)


def config(backend: str = "ddp", **changes) -> EngineConfig:
    changes.setdefault("device", "cpu")
    return EngineConfig(backend=backend, model=ModelConfig(path="/nonexistent/model"), **changes)


def test_options_default_to_the_backends_config_class(registry) -> None:
    original = config()
    engine = build_engine(original, role="value", registry=registry)
    assert type(engine) is DDPEngine and isinstance(engine, BaseEngine)
    assert engine.role == "value" and engine.config.options == DDPConfig()
    assert original.options is None  # the caller's config is left as it was


def test_options_instance_is_passed_through(registry) -> None:
    options = DDPConfig(bucket_cap_mb=4.0, static_graph=True)
    assert build_engine(config(options=options), registry=registry).options is options


def test_options_of_another_type_name_the_expected_class(registry) -> None:
    expected = (
        r"actor\.engine\.options: expected an instance of verl_ddp\.config\.DDPConfig \(the options of "
        r"engine backend 'ddp'\) or None for its defaults, got builtins\.dict"
    )
    with pytest.raises(ConfigError, match=expected):
        build_engine(config(options={"bucket_cap_mb": 4}), registry=registry, config_path="actor.engine")


def test_unsupported_role_names_backend_provider_and_roles(registry) -> None:
    message = re.escape(
        "role: engine backend 'lm-on-cuda' from plugin 'NarrowPlugin' (no distribution) supports roles "
        "lm, not 'value'"
    )
    with pytest.raises(ConfigError, match=message):
        build_engine(config("lm-on-cuda", device="cuda"), role="value", registry=registry)


def test_unsupported_device_names_backend_provider_and_devices(registry) -> None:
    message = re.escape(
        "engine.device: 'cpu' (cpu): engine backend 'lm-on-cuda' from plugin 'NarrowPlugin' (no distribution) "
        "supports devices ('cuda',); pick one of them or another backend"
    )
    with pytest.raises(ConfigError, match=message):
        build_engine(config("lm-on-cuda"), registry=registry)


def test_engine_that_is_not_a_base_engine_is_refused(registry) -> None:
    with pytest.raises(
        PluginValidationError, match=r"engine backend 'not-an-engine' .*is not a subclass of .*BaseEngine"
    ):
        build_engine(config("not-an-engine"), registry=registry)


def test_unknown_backend_lists_what_is_installed(registry) -> None:
    with pytest.raises(
        UnknownNameError, match=r"(?s)Unknown engine backend 'dpp' \(from engine\.backend\).*'ddp'"
    ):
        build_engine(config("dpp"), registry=registry)
