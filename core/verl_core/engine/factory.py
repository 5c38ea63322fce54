"""Build an engine from its config: look up the backend, check it fits, construct it."""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING

import attrs

from verl_core.config.engine import EngineConfig
from verl_core.deprecation import declare, moved_names
from verl_core.descriptors import ModelRole
from verl_core.engine.base import BaseEngine
from verl_core.engine.device import device_type
from verl_core.errors import ConfigError, PluginValidationError
from verl_core.hookspecs import Kind

if TYPE_CHECKING:
    from verl_core.plugins import Registry
    from verl_core.plugins.registry import Entry


def build_engine(
    config: EngineConfig,
    role: ModelRole | str = ModelRole.LM,
    registry: Registry | None = None,
    *,
    config_path: str = "engine",
) -> BaseEngine:
    """The engine ``config.backend`` names, for ``role`` (a ``ModelRole``: ``lm`` or ``value``), not yet
    initialised.

    ``registry`` defaults to the process-wide one (installed plugins). ``config.options`` must be an
    instance of the backend's config class, or ``None`` for its defaults (the engine checks it).
    ``config_path`` is where ``config`` sits in the run config (``actor.engine``), for errors. Call
    ``initialize()`` on the result before using it.
    """
    from verl_core.plugins.registry import registry_or_installed

    registry = registry_or_installed(registry)
    entry = registry.entry(Kind.ENGINE_BACKENDS, config.backend, where=f"{config_path}.backend")
    backend, provider = entry.descriptor, entry.provider

    role = ModelRole(role)
    if role not in backend.roles:
        supported = ", ".join(map(str, backend.roles))
        raise ConfigError(
            [
                (
                    "role",
                    f"engine backend '{backend.name}' from {provider} supports roles {supported}, not '{role}'",
                )
            ]
        )
    device = device_type(config.device, f"{config_path}.device")
    if device not in backend.devices:
        raise ConfigError(
            [
                (
                    f"{config_path}.device",
                    f"{config.device!r} ({device}): engine backend '{backend.name}' from {provider} supports "
                    f"devices {backend.devices}; pick one of them or another backend",
                )
            ]
        )

    refusals = capability_refusals(config, registry, config_path)
    if refusals:
        raise ConfigError(refusals)
    if config.micro_batch.share_prompts is None:  # the backend's own default
        micro_batch = attrs.evolve(config.micro_batch, share_prompts=backend.shared_prompts)
        config = attrs.evolve(config, micro_batch=micro_batch)
    return _construct(load_engine_class(entry), config, role, config_path)


def load_engine_class(entry: Entry) -> type[BaseEngine]:
    """The engine class of the engine backend ``entry``, imported and checked: a ``BaseEngine`` subclass
    whose ``options_class`` is the descriptor's ``config`` class. Raises ``PluginLoadError`` when the
    import string does not import (naming the plugin, its distribution, the string and the cause, which
    is chained) and ``PluginValidationError`` otherwise. The run's early checks call it on the driver
    (``verl_core.trainer.preflight``), so that a plugin's broken engine is refused before any rank starts."""
    backend, provider = entry.descriptor, entry.provider
    engine_class = entry.load("engine")
    if not (isinstance(engine_class, type) and issubclass(engine_class, BaseEngine)):
        raise PluginValidationError(
            f"engine backend '{backend.name}' from {provider}: engine {backend.engine!r} is not a subclass of "
            "verl_core.engine.BaseEngine; fix the plugin's EngineBackend(engine=...)"
        )
    # The descriptor's options class is what configs are structured into; the engine checks instances
    # against its own ``options_class``: the two must be one class, or no config could ever pass.
    options_class = entry.load("config")
    if engine_class.options_class is not None and engine_class.options_class is not options_class:
        raise PluginValidationError(
            f"engine backend '{backend.name}' from {provider}: EngineBackend(config={backend.config!r}) names "
            f"{options_class.__module__}.{options_class.__qualname__}, but the engine's options_class is "
            f"{engine_class.options_class.__module__}.{engine_class.options_class.__qualname__}; make them "
            "the same class"
        )
    return engine_class


def capability_refusals(config: EngineConfig, registry: Registry, config_path: str) -> list[tuple[str, str]]:
    """The ``(key, message)`` refusing each of ``config``'s settings that need a capability its backend
    does not declare: LoRA (``EngineBackend(lora=True)``) and ``micro_batch.share_prompts: true``
    (``EngineBackend(shared_prompts=True)``). Also the run's early checks
    (``verl_core.trainer.preflight``), so that a refusal comes before any worker starts."""
    entry = registry.entry(Kind.ENGINE_BACKENDS, config.backend, where=f"{config_path}.backend")
    backend = f"engine backend '{config.backend}' from {entry.provider}"
    refusals = []
    if config.model.lora and not entry.descriptor.lora:
        refusals.append(
            (
                f"{config_path}.model.{config.model.lora_key}",
                f"{backend} does not train LoRA adapters (it does not declare EngineBackend(lora=True)): LoRA "
                "comes with core's HFEngine toolkit, where peft adapts the Hugging Face model's linear layers, "
                "and an engine with layers of its own (megatron-core's tensor-parallel ones) would need "
                "adapters of its own; unset it to train the full model, or use a backend that trains LoRA: "
                f"{declaring_backends(registry, 'lora')}",
            )
        )
    if config.micro_batch.share_prompts and not entry.descriptor.shared_prompts:
        refusals.append(
            (
                f"{config_path}.micro_batch.share_prompts",
                f"{backend} does not compute shared prompts once (it does not declare "
                "EngineBackend(shared_prompts=True); megatron runs its micro-batches padded, without "
                "packing); unset it to let the backend choose, or use a backend that shares prompts: "
                f"{declaring_backends(registry, 'shared_prompts')}",
            )
        )
    return refusals


def declaring_backends(registry: Registry, capability: str) -> list[str]:
    """The engine backends whose descriptor declares ``capability``."""
    return sorted(
        entry.descriptor.name
        for entry in registry.entries(Kind.ENGINE_BACKENDS)
        if getattr(entry.descriptor, capability)
    )


def _construct(
    engine_class: type[BaseEngine], config: EngineConfig, role: str, config_path: str
) -> BaseEngine:
    """``engine_class(config, role=role, config_path=config_path)``; an engine written for verl-core 0.1,
    whose ``__init__`` takes no ``config_path``, is built without it and given the attribute, with a
    deprecation warning pointing at its ``__init__`` (once per engine class)."""
    parameters = inspect.signature(engine_class.__init__).parameters.values()
    if any(p.name == "config_path" or p.kind is p.VAR_KEYWORD for p in parameters):
        return engine_class(config, role=role, config_path=config_path)
    _warn_without_config_path(engine_class)
    engine = engine_class(config, role=role)
    engine.config_path = config_path
    return engine


def _warn_without_config_path(engine_class: type) -> None:
    # Attributed to the engine's own __init__, not to this line: shown once per engine class, where its
    # author has to change something.
    code = getattr(engine_class.__init__, "__code__", None)
    warnings.warn_explicit(
        f"{engine_class.__module__}.{engine_class.__qualname__}: {ENGINE_INIT_WITHOUT_CONFIG_PATH.message}",
        ENGINE_INIT_WITHOUT_CONFIG_PATH.category,
        filename=code.co_filename if code else "<unknown>",
        lineno=code.co_firstlineno if code else 0,
        module=engine_class.__module__,
        registry=_WARNED_ENGINE_INITS.setdefault(engine_class, {}),
    )


#: ``BaseEngine.__init__`` gained ``config_path`` in 0.2.0; engines written for 0.1 do not accept it.
ENGINE_INIT_WITHOUT_CONFIG_PATH = declare(
    "an engine __init__ without a config_path argument",
    since="0.2.0",
    removed_in="0.4.0",
    replacement=(
        "__init__(self, config, role='lm', *, config_path='engine') passing config_path=config_path on to "
        "BaseEngine.__init__"
    ),
)
#: Per engine class, where ``warn_explicit`` has already warned.
_WARNED_ENGINE_INITS: dict[type, dict] = {}

__getattr__ = moved_names(
    __name__, {"KIND": "verl_core.plugins:Kind.ENGINE_BACKENDS"}, since="0.2.0", removed_in="0.4.0"
)
