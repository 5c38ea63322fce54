"""Plain data <-> verl-core's config classes, with every error reported at its full dotted path.

``structure`` builds a config class from YAML-loaded data on the strict converter of
``verl_core.config.strict`` (no coercion, every error at its path, sections that keep checking their
rules when another has errors), adding verl-core's own semantics: the names of registered components
are looked up in the registry of the call in progress, and an engine or rollout section's options are
structured into its backend's own options class, selected by the section's ``backend`` name (in YAML
they sit under a key named after the backend). Options the run will ignore (a class's ``ignored()``,
another backend's section) become ``ConfigWarning`` s.
"""

from __future__ import annotations

import typing
import warnings
from typing import Any, TypeVar

import attrs
from cattrs.gen import make_dict_unstructure_fn

from verl_core.config import names
from verl_core.config.engine import EngineConfig
from verl_core.config.problems import Errors, errors_of, join_path, unknown_key_message
from verl_core.config.run import RolloutConfig
from verl_core.config.strict import (
    Draft,
    converter,
    current_path,
    finish_section,
    ignored_options,
    section_mapping,
    structure_fields,
    unvalidated_copy,
    warn_ignored,
)
from verl_core.errors import ConfigError, ConfigWarning
from verl_core.hookspecs import Kind

if typing.TYPE_CHECKING:
    from verl_core.plugins import Registry

T = TypeVar("T")

__all__ = ["join_path", "structure", "structure_with_warnings", "unknown_key_message", "unstructure"]


def structure(data: Any, cls: type[T], path: str = "", *, registry: Registry | None = None) -> T:
    """Build ``cls`` from plain data (YAML-loaded dicts, lists and scalars).

    Raises ``ConfigError`` listing every problem, each at its dotted path below ``path`` (the
    position of ``data`` in a larger config, for the messages). ``registry`` resolves backend and
    other component names; by default the process-wide ``verl_core.plugins.get_registry()``.
    Options the result will ignore are issued as ``ConfigWarning`` s, each ``path: message``.
    """
    result, ignored = structure_with_warnings(data, cls, path, registry=registry)
    for where, message in ignored:
        warnings.warn(ConfigWarning(f"{where}: {message}"), stacklevel=2)
    return result


def structure_with_warnings(
    data: Any, cls: type[T], path: str = "", *, registry: Registry | None = None
) -> tuple[T, Errors]:
    """Like ``structure``, but return the warnings as ``(full.path, message)`` pairs instead of issuing
    them (``load_config`` adds where each value was set)."""
    tokens = [
        (names.lookup_registry, names.lookup_registry.set(registry)),
        (current_path, current_path.set(path)),
        (ignored_options, ignored_options.set([])),
    ]
    try:
        return converter.structure(data, cls), list(ignored_options.get() or [])
    except Exception as exc:
        raise ConfigError(errors_of(exc, path)) from None
    finally:
        for variable, token in reversed(tokens):
            variable.reset(token)


def unstructure(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) that ``structure`` turns back into an equal ``obj`` and
    that YAML can hold: tuples become lists, backend options sit under the backend's name."""
    return converter.unstructure(obj)


def _load_options_class(registry: Registry, kind: str, name: str) -> type:
    # Both raise errors naming the plugin and the fix: an unknown name lists what is installed.
    return registry.entry(kind, name).load("config")


def _make_backend_options_hooks(cls: type, kind: str) -> tuple[Any, Any]:
    """Hooks for a section with a ``backend`` name of registry ``kind`` and ``options`` of that
    backend's own class (the descriptor's ``config``): ``EngineConfig`` and ``Kind.ENGINE_BACKENDS``,
    ``RolloutConfig`` and ``Kind.ROLLOUT_BACKENDS``.

    In YAML the options sit under a key named after the backend (``fsdp: {...}``). A key named after
    another installed backend of ``kind`` is accepted, so that one override switches backends, and
    warned about: the run ignores it.
    """
    attrs.resolve_types(cls)
    stand_in = unvalidated_copy(cls)
    fields = [field for field in attrs.fields(cls) if field.init and field.name != "options"]
    keys = [field.name for field in fields]
    default_backend = attrs.fields_dict(cls)["backend"].default  # ``NOTHING``: required
    unstructure_fields = make_dict_unstructure_fn(cls, converter)

    def structure_with_options(value: Any, _: type = cls) -> Any:
        value = section_mapping(value, cls)
        registry = names.current_registry()
        installed = registry.names(kind)
        draft = Draft(cls)
        structure_fields(draft, fields, {key: item for key, item in value.items() if key in keys})
        name = draft.values.get("backend", default_backend)
        options_class = None
        if "backend" not in draft.failed and isinstance(name, str):
            try:
                options_class = _load_options_class(registry, kind, name)
            except Exception as exc:
                draft.fail("backend", names.one_line(exc))
        backend_path = join_path(current_path.get(), "backend")
        for key in value:
            if key == "options":  # the attribute's name; YAML spells it after the backend
                draft.errors.append(
                    (key, f"unknown key: the options of backend '{name}' go under its name ({name}: {{...}})")
                )
            elif key in installed and key != name and options_class is not None:
                warn_ignored(
                    str(key),
                    f"ignored: {backend_path} is '{name}'; the options of backend '{key}' apply once "
                    f"{backend_path}={key}",
                )
            elif key not in keys and key != name and key not in installed:
                draft.errors.append((str(key), unknown_key_message(str(key), [*keys, *installed])))
        if options_class is not None:
            draft.structure("options", value.get(name), options_class, key=name)
        else:
            draft.failed.add("options")  # no options without a backend; its error is reported
        return finish_section(draft, stand_in)

    def unstructure_with_options(section: Any) -> dict[str, Any]:
        data = unstructure_fields(section)
        options = data.pop("options")
        backend = {"backend": data.pop("backend")}
        if section.options is not None:
            backend[section.backend] = options
        return {**backend, **data}

    return structure_with_options, unstructure_with_options


def _register_backend_options_hooks() -> None:
    for cls, kind in ((EngineConfig, Kind.ENGINE_BACKENDS), (RolloutConfig, Kind.ROLLOUT_BACKENDS)):
        structure_hook, unstructure_hook = _make_backend_options_hooks(cls, kind)
        converter.register_structure_hook(cls, structure_hook)
        converter.register_unstructure_hook(cls, unstructure_hook)


_register_backend_options_hooks()
