"""Plain data <-> config classes, with every error reported at its full dotted path.

cattrs structures the attrs classes (unknown keys refused, errors collected per field); the hooks
here make it strict where cattrs would coerce (``"1e-5"`` into a float, ``"abc"`` into a list of
characters, ``2.7`` into ``2``), run each class's field validators and ``check()``, and select a
backend's own options class by the ``backend`` name of an engine section. Every failure becomes a
``(path, message)`` pair in one ``ConfigError``.
"""

from __future__ import annotations

import contextvars
import difflib
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal, TypeVar

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn_from_attrs, make_dict_unstructure_fn

from verl_core.config.engine import EngineConfig
from verl_core.config.validators import InvalidValue
from verl_core.errors import ConfigError
from verl_core.hookspecs import ENGINE_BACKENDS

if typing.TYPE_CHECKING:
    from verl_core.plugins import Registry

T = TypeVar("T")
Errors = list[tuple[str, str]]

_converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
#: The registry that ``backend`` names are looked up in, for the ``structure`` call in progress.
_registry: contextvars.ContextVar[Registry | None] = contextvars.ContextVar("registry", default=None)


# -- public API -----------------------------------------------------------------------------------


def structure(data: Any, cls: type[T], path: str = "", *, registry: Registry | None = None) -> T:
    """Build ``cls`` from plain data (YAML-loaded dicts, lists and scalars).

    Raises ``ConfigError`` listing every problem, each at its dotted path below ``path`` (the
    position of ``data`` in a larger config, for the messages). ``registry`` resolves engine backend
    names; by default the process-wide ``verl_core.plugins.get_registry()``.
    """
    token = _registry.set(registry)
    try:
        return _converter.structure(data, cls)
    except Exception as exc:
        raise ConfigError(_errors_of(exc, path)) from None
    finally:
        _registry.reset(token)


def unstructure(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) that ``structure`` turns back into an equal ``obj`` and
    that YAML can hold: tuples become lists, backend options sit under the backend's name."""
    return _converter.unstructure(obj)


def unknown_key_message(key: str, allowed: list[str]) -> str:
    """``unknown key (did you mean lr?)``, or the allowed keys when none is close."""
    match = difflib.get_close_matches(key, allowed, n=1)
    if match:
        return f"unknown key (did you mean {match[0]}?)"
    return f"unknown key (allowed keys: {', '.join(allowed)})"


# -- errors ---------------------------------------------------------------------------------------


def join_path(prefix: str, step: str) -> str:
    """``actor`` + ``optim`` -> ``actor.optim``; ``data.train_files`` + ``[1]`` -> ``data.train_files[1]``."""
    if not step:
        return prefix
    if not prefix:
        return step
    return prefix + step if step.startswith("[") else f"{prefix}.{step}"


def _step_of(exc: BaseException) -> str | None:
    """The field name or ``[index]`` / key that cattrs noted on ``exc`` while collecting it."""
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            return note.name
        if isinstance(note, IterableValidationNote):
            return f"[{note.index}]" if isinstance(note.index, int) else str(note.index)
    return None


def _errors_of(exc: BaseException, path: str) -> Errors:
    """Flatten what structuring raised into ``(full.path, message)`` pairs, in field order."""
    if isinstance(exc, ConfigError):
        return [(join_path(path, sub_path), message) for sub_path, message in exc.errors]
    if isinstance(exc, ForbiddenExtraKeysError):
        allowed = [field.name for field in attrs.fields(exc.cl) if field.init]
        return [
            (join_path(path, key), unknown_key_message(key, allowed))
            for key in sorted(map(str, exc.extra_fields))
        ]
    if isinstance(exc, BaseValidationError):
        errors: Errors = []
        for sub in exc.exceptions:
            step = _step_of(sub)
            sub_path = join_path(path, step) if step is not None else path
            if isinstance(sub, KeyError) and step is not None and sub.args == (step,):
                errors.append(
                    (sub_path, "required key is missing: set it in the YAML file or with an override")
                )
            else:
                errors += _errors_of(sub, sub_path)
        return errors
    if isinstance(exc, (TypeError, ValueError)):
        return [(path, str(exc))]
    return [(path, f"{type(exc).__name__}: {exc}")]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _mismatch(expected: str, value: Any) -> TypeError:
    hint = " (quote it to make it a string)" if expected == "str" and isinstance(value, (int, float)) else ""
    return TypeError(f"expected {expected}, got {_short(value)}{hint}")


# -- scalars: no coercion -------------------------------------------------------------------------


def _structure_bool(value: Any, _: type) -> bool:
    if isinstance(value, bool):
        return value
    raise _mismatch("bool (true or false)", value)


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _mismatch("int", value)


def _structure_float(value: Any, _: type) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _mismatch("float", value)


def _structure_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return value
    raise _mismatch("str", value)


def _structure_literal(value: Any, literal: Any) -> Any:
    allowed = typing.get_args(literal)
    if any(value == option and type(value) is type(option) for option in allowed):
        return value
    names = [option for option in allowed if isinstance(option, str)]
    match = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
    suggestion = f" (did you mean {match[0]!r}?)" if match else ""
    raise ValueError(f"expected one of {', '.join(map(repr, allowed))}; got {_short(value)}{suggestion}")


# -- containers -----------------------------------------------------------------------------------


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_optional(tp: Any) -> bool:
    return _is_union(tp) and len(typing.get_args(tp)) == 2 and type(None) in typing.get_args(tp)


def _structure_optional(value: Any, optional: Any) -> Any:
    if value is None:
        return None
    (inner,) = [arg for arg in typing.get_args(optional) if arg is not type(None)]
    return _converter.structure(value, inner)


def _structure_items(values: Any, item_types: list[Any]) -> list[Any]:
    items, errors = [], []
    for index, (value, item_type) in enumerate(zip(values, item_types, strict=True)):
        try:
            items.append(_converter.structure(value, item_type))
        except Exception as exc:
            errors += _errors_of(exc, f"[{index}]")
    if errors:
        raise ConfigError(errors)
    return items


def _structure_list(value: Any, list_type: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise _mismatch("a list", value)
    (item_type,) = typing.get_args(list_type) or (Any,)
    return _structure_items(value, [item_type] * len(value))


def _structure_tuple(value: Any, tuple_type: Any) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _mismatch("a list", value)
    item_types = list(typing.get_args(tuple_type))
    if not item_types or item_types[-1] is Ellipsis:
        item_types = [item_types[0] if item_types else Any] * len(value)
    elif len(value) != len(item_types):
        raise TypeError(f"expected a list of {len(item_types)} items, got {len(value)}: {_short(value)}")
    return tuple(_structure_items(value, item_types))


def _structure_dict(value: Any, dict_type: Any) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise _mismatch("a mapping", value)
    key_type, item_type = typing.get_args(dict_type) or (Any, Any)
    result, errors = {}, []
    for key, item in value.items():
        try:
            result[_converter.structure(key, key_type)] = _converter.structure(item, item_type)
        except Exception as exc:
            errors += _errors_of(exc, str(key))
    if errors:
        raise ConfigError(errors)
    return result


def _unstructure_tuple(value: tuple[Any, ...]) -> list[Any]:
    return [_converter.unstructure(item) for item in value]


# -- config classes -------------------------------------------------------------------------------


def _field_errors(instance: Any) -> Iterator[tuple[str, str]]:
    """Run every field validator of ``instance`` (and its ``check()``), collecting the failures."""
    for field in attrs.fields(type(instance)):
        if field.validator is None:
            continue
        try:
            field.validator(instance, field, getattr(instance, field.name))
        except InvalidValue as exc:
            yield exc.field, exc.message
        except Exception as exc:
            yield field.name, str(exc)
    check = getattr(instance, "check", None)
    if callable(check):
        yield from check()


def _section_mapping(value: Any, cls: type) -> Mapping[str, Any]:
    if value is None:  # ``section:`` with every key commented out
        return {}
    if not isinstance(value, Mapping):
        raise _mismatch(f"a mapping of {cls.__name__} keys", value)
    return value


def _unvalidated_copy(cls: type) -> type:
    """A class with the fields of ``cls`` (defaults, converters, aliases) but no validators or methods."""
    fields = {
        field.name: attrs.field(
            default=field.default,
            converter=field.converter,
            init=field.init,
            alias=field.alias,
            kw_only=field.kw_only,
        )
        for field in attrs.fields(cls)
    }
    return attrs.make_class(cls.__name__, fields, slots=False)


def _make_section_hook(cls: type[T]) -> Any:
    """Structure ``cls`` from a mapping with cattrs, validate its fields and run ``check()``, then build it.

    The validators run one by one before ``cls`` is built, so that all failures are reported; its
    ``__init__`` would stop at the first. cattrs builds a copy without validators and they check a
    stand-in holding the copy's values. (``attrs.validators.disabled()`` would also do, but it switches
    validators off in every thread.)
    """
    attrs.resolve_types(cls)  # cattrs takes the field types from ``cls``; the copy has none
    structure_fields = make_dict_structure_fn_from_attrs(
        list(attrs.fields(cls)), _unvalidated_copy(cls), _converter
    )

    def structure_section(value: Any, _: type = cls) -> T:
        values = structure_fields(_section_mapping(value, cls))
        instance = object.__new__(cls)  # its ``__init__`` would run the validators
        for name, field_value in vars(values).items():
            object.__setattr__(instance, name, field_value)
        errors = list(_field_errors(instance))
        if errors:
            raise ConfigError(errors)
        return attrs.evolve(instance)  # built by ``__init__`` after all, now that its validators pass

    return structure_section


def _current_registry() -> Registry:
    registry = _registry.get()
    if registry is None:
        from verl_core.plugins import get_registry  # discovery only when a backend is looked up

        registry = get_registry()
    return registry


def _load_options_class(registry: Registry, kind: str, name: str) -> type:
    # Both raise errors naming the plugin and the fix: an unknown name lists what is installed.
    return registry.entry(kind, name).load("config")


def _make_backend_options_hooks(cls: type, kind: str) -> tuple[Any, Any]:
    """Hooks for a section with a ``backend`` name and ``options`` of that backend's own class.

    In YAML the options sit under a key named after the backend (``fsdp: {...}``). A key named after
    another installed backend of ``kind`` is ignored, so that one override switches backends.
    """
    structure_fields = _make_section_hook(cls)
    unstructure_fields = make_dict_unstructure_fn(cls, _converter)
    keys = [field.name for field in attrs.fields(cls) if field.name != "options"]

    def structure_with_options(value: Any, _: type = cls) -> Any:
        value = _section_mapping(value, cls)
        name = value.get("backend")
        registry = _current_registry()
        errors: Errors = []
        options_class = None
        if isinstance(name, str):  # otherwise structuring ``backend`` reports the bad value
            try:
                options_class = _load_options_class(registry, kind, name)
            except Exception as exc:
                errors.append(("backend", " ".join(str(exc).splitlines())))
        installed = registry.names(kind)
        fields = {key: item for key, item in value.items() if key in keys}
        for key in value:
            if key == "options":  # the attribute's name; YAML spells it after the backend
                errors.append(
                    (key, f"unknown key: the options of backend '{name}' go under its name ({name}: {{...}})")
                )
            elif key not in keys and key != name and key not in installed:
                errors.append((str(key), unknown_key_message(str(key), [*keys, *installed])))
        if options_class is not None:
            try:
                fields["options"] = _converter.structure(value.get(name), options_class)
            except Exception as exc:
                errors += _errors_of(exc, name)
        try:
            section = structure_fields(fields)
        except Exception as exc:
            errors = _errors_of(exc, "") + errors
        if errors:
            raise ConfigError(errors)
        return section

    def unstructure_with_options(section: Any) -> dict[str, Any]:
        data = unstructure_fields(section)
        options = data.pop("options")
        backend = {"backend": data.pop("backend")}
        if section.options is not None:
            backend[section.backend] = options
        return {**backend, **data}

    return structure_with_options, unstructure_with_options


def _register_hooks() -> None:
    for scalar, hook in (
        (bool, _structure_bool),
        (int, _structure_int),
        (float, _structure_float),
        (str, _structure_str),
    ):
        _converter.register_structure_hook(scalar, hook)
    # Later registrations win: the generic attrs hook first, so that the specific ones override it.
    _converter.register_structure_hook_factory(attrs.has, _make_section_hook)
    _converter.register_structure_hook_func(lambda tp: typing.get_origin(tp) is Literal, _structure_literal)
    _converter.register_structure_hook_func(_is_optional, _structure_optional)
    _converter.register_structure_hook_func(
        lambda tp: tp is list or typing.get_origin(tp) is list, _structure_list
    )
    _converter.register_structure_hook_func(
        lambda tp: tp is tuple or typing.get_origin(tp) is tuple, _structure_tuple
    )
    _converter.register_structure_hook_func(
        lambda tp: tp is dict or typing.get_origin(tp) is dict, _structure_dict
    )
    _converter.register_unstructure_hook_func(
        lambda tp: tp is tuple or typing.get_origin(tp) is tuple, _unstructure_tuple
    )

    structure_engine, unstructure_engine = _make_backend_options_hooks(EngineConfig, ENGINE_BACKENDS)
    _converter.register_structure_hook(EngineConfig, structure_engine)
    _converter.register_unstructure_hook(EngineConfig, unstructure_engine)


_register_hooks()
