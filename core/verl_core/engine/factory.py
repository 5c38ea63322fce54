"""Build an engine from its config: look up the backend, check it fits, construct it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from verl_core.config.engine import EngineConfig
from verl_core.descriptors import EngineBackend
from verl_core.engine.base import BaseEngine
from verl_core.engine.device import device_type
from verl_core.errors import ConfigError

if TYPE_CHECKING:
    from verl_core.plugins import Registry

KIND = "engine_backends"


def build_engine(config: EngineConfig, role: str = "lm", registry: Registry | None = None) -> BaseEngine:
    """The engine ``config.backend`` names, for ``role`` (``lm`` or ``value``), not yet initialised.

    ``registry`` defaults to the process-wide one (installed plugins). ``config.options`` must be an
    instance of the backend's config class, or ``None`` for its defaults. Call ``initialize()`` on
    the result before using it.
    """
    if registry is None:
        from verl_core.plugins import get_registry

        registry = get_registry()
    backend: EngineBackend = registry.get(KIND, config.backend, where="engine.backend")
    provider = _provider(registry, backend)

    if role not in backend.roles:
        raise ConfigError(
            [
                (
                    "role",
                    f"engine backend '{backend.name}' from {provider} supports roles {backend.roles}, not {role!r}",
                )
            ]
        )
    device = device_type(config.device)
    if device not in backend.devices:
        raise ConfigError(
            [
                (
                    "engine.device",
                    f"{config.device!r} ({device}): engine backend '{backend.name}' from {provider} supports "
                    f"devices {backend.devices}; pick one of them or another backend",
                )
            ]
        )

    config_class = backend.load_config()
    options = config.options
    if options is None:
        options = config_class()
    elif not isinstance(options, config_class):
        raise ConfigError(
            [
                (
                    "engine.options",
                    f"expected an instance of {config_class.__module__}.{config_class.__qualname__} (the "
                    f"options of engine backend '{backend.name}' from {provider}) or None for its defaults, "
                    f"got {type(options).__module__}.{type(options).__qualname__}",
                )
            ]
        )

    engine_class = backend.load_engine()
    if not (isinstance(engine_class, type) and issubclass(engine_class, BaseEngine)):
        raise TypeError(
            f"engine backend '{backend.name}' from {provider}: engine {backend.engine!r} is not a subclass of "
            "verl_core.engine.BaseEngine; fix the plugin's EngineBackend(engine=...)"
        )
    return engine_class(attrs.evolve(config, options=options), role=role)


def _provider(registry: Registry, backend: EngineBackend) -> str:
    """How messages name the plugin and distribution that provide ``backend``."""
    for entry in registry.entries(KIND):
        if entry.descriptor is backend:
            return entry.provider
    return "an unknown plugin"
