"""A strict cattrs converter for attrs config classes, with every error reported at its full dotted path.

The hooks here structure attrs classes field by field (unknown keys refused, errors collected per
field) and are strict where cattrs would coerce (``"1e-5"`` into a float, ``"abc"`` into a list of
characters, ``2.7`` into ``2``, ``.inf`` into a learning rate). A section runs its field validators,
looks up the names of registered components (``verl_core.config.names``) and runs its ``check()``
rules; every failure becomes a ``(path, message)`` pair. A section with errors does not hide the
others' rules: it is handed on holding the fields whose values are valid (the others unset), so that
rules whose inputs are there still run and rules that read an unset field are skipped
(``verl_core.config.validators.each_rule``). Each error's path and wording: ``problems``. Options the run will ignore (a class's ``ignored()``)
are recorded in ``ignored_options``. Nothing here knows verl-core's sections: ``convert`` adds those.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar

import attrs
import cattrs

from verl_core.config import names
from verl_core.config.problems import (
    MISSING_KEY,
    Errors,
    errors_of,
    join_path,
    mismatch,
    short_repr,
    unknown_key_message,
)
from verl_core.config.validators import InvalidValue, is_unstructured
from verl_core.errors import ConfigError, did_you_mean

T = TypeVar("T")


converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
#: Full dotted path of the value being structured (errors get theirs on the way up; warnings here).
current_path: contextvars.ContextVar[str] = contextvars.ContextVar("path", default="")
#: ``(full.path, message)`` of each option the run will ignore, for the ``structure`` call in progress.
ignored_options: contextvars.ContextVar[Errors | None] = contextvars.ContextVar("warnings", default=None)


# -- scalars: no coercion -------------------------------------------------------------------------


def _structure_bool(value: Any, _: type) -> bool:
    if isinstance(value, bool):
        return value
    raise mismatch("bool (true or false)", value)


def _structure_int(value: Any, _: type) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise mismatch("int", value)


def _structure_float(value: Any, _: type) -> float:
    # Finite only: no option takes .inf or .nan, and a NaN learning rate fails no range check.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the floats
            number = math.inf
        if math.isfinite(number):
            return number
        raise ValueError(f"expected a finite float, got {short_repr(value)}")
    raise mismatch("float", value)


def _structure_str(value: Any, _: type) -> str:
    if isinstance(value, str):
        return value
    raise mismatch("str", value)


def _structure_literal(value: Any, literal: Any) -> Any:
    allowed = typing.get_args(literal)
    if any(value == option and type(value) is type(option) for option in allowed):
        return value
    names = [option for option in allowed if isinstance(option, str)]
    raise ValueError(
        f"expected one of {', '.join(map(repr, allowed))}; got {short_repr(value)}{did_you_mean(value, names)}"
    )


# -- containers -----------------------------------------------------------------------------------


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_optional(tp: Any) -> bool:
    return _is_union(tp) and len(typing.get_args(tp)) == 2 and type(None) in typing.get_args(tp)


def _structure_optional(value: Any, optional: Any) -> Any:
    if value is None:
        return None
    (inner,) = [arg for arg in typing.get_args(optional) if arg is not type(None)]
    return converter.structure(value, inner)


def _is_str_or_list(tp: Any) -> bool:
    """``str | list[...]``: one name, or several (``target_modules: all-linear`` or ``[q_proj, v_proj]``)."""
    if not _is_union(tp) or len(typing.get_args(tp)) != 2 or str not in typing.get_args(tp):
        return False
    (other,) = [arg for arg in typing.get_args(tp) if arg is not str]
    return typing.get_origin(other) is list


def _structure_str_or_list(value: Any, union: Any) -> Any:
    if isinstance(value, str):
        return value
    (list_type,) = [arg for arg in typing.get_args(union) if arg is not str]
    if not isinstance(value, (list, tuple)):
        raise mismatch("a str or a list", value)
    return _structure_list(value, list_type)


#: Scalar types, in the order a union of them tries them: a bool is an int, so it goes to bool only.
_SCALARS = (bool, int, float, str)


def _is_scalar_union(tp: Any) -> bool:
    """A union of scalar types, optionally with ``None`` (``float | str``: a cap, or ``"0.5_5.0"``)."""
    members = [arg for arg in typing.get_args(tp) if arg is not type(None)] if _is_union(tp) else []
    return len(members) > 1 and all(member in _SCALARS for member in members)


def _structure_scalar_union(value: Any, union: Any) -> Any:
    members = typing.get_args(union)
    if value is None and type(None) in members:
        return None
    numbers = (int, float)
    for member in _SCALARS:
        fits = (
            isinstance(value, member)
            if member in (bool, str)
            else isinstance(value, numbers if member is float else int) and not isinstance(value, bool)
        )
        if member in members and fits:
            return converter.structure(value, member)
    expected = " or ".join(member.__name__ for member in _SCALARS if member in members)
    raise mismatch(expected + (" or null" if type(None) in members else ""), value)


def _structure_items(values: Any, item_types: list[Any]) -> list[Any]:
    items, errors = [], []
    for index, (value, item_type) in enumerate(zip(values, item_types, strict=True)):
        try:
            with _at(f"[{index}]"):
                items.append(converter.structure(value, item_type))
        except Exception as exc:
            errors += errors_of(exc, f"[{index}]")
    if errors:
        raise ConfigError(errors)
    return items


def _structure_list(value: Any, list_type: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise mismatch("a list", value)
    (item_type,) = typing.get_args(list_type) or (Any,)
    return _structure_items(value, [item_type] * len(value))


def _structure_tuple(value: Any, tuple_type: Any) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise mismatch("a list", value)
    item_types = list(typing.get_args(tuple_type))
    if not item_types or item_types[-1] is Ellipsis:
        item_types = [item_types[0] if item_types else Any] * len(value)
    elif len(value) != len(item_types):
        raise TypeError(f"expected a list of {len(item_types)} items, got {len(value)}: {short_repr(value)}")
    return tuple(_structure_items(value, item_types))


def _structure_dict(value: Any, dict_type: Any) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise mismatch("a mapping", value)
    key_type, item_type = typing.get_args(dict_type) or (Any, Any)
    result, errors = {}, []
    for key, item in value.items():
        try:
            with _at(str(key)):
                result[converter.structure(key, key_type)] = converter.structure(item, item_type)
        except Exception as exc:
            errors += errors_of(exc, str(key))
    if errors:
        raise ConfigError(errors)
    return result


def _unstructure_tuple(value: tuple[Any, ...]) -> list[Any]:
    return [converter.unstructure(item) for item in value]


# -- config classes -------------------------------------------------------------------------------


@contextlib.contextmanager
def _at(step: str) -> Iterator[None]:
    """Structure the value at ``step`` below the current path (for the warnings it gives)."""
    token = current_path.set(join_path(current_path.get(), step))
    try:
        yield
    finally:
        current_path.reset(token)


def warn_ignored(step: str, message: str) -> None:
    """Record that the run will ignore the option at ``step`` below the current path."""
    found = ignored_options.get()
    if found is not None:
        found.append((join_path(current_path.get(), step), message))


class SectionError(ConfigError):
    """The errors of a section, with what of it structured: ``partial`` is an instance of the class
    holding the fields whose values are valid and none of the others (reading one raises
    ``AttributeError``), for the rules of the sections around it."""

    def __init__(self, errors: Errors, partial: Any):
        super().__init__(errors)
        self.partial = partial


@attrs.define
class Draft:
    """A section being structured: the values that structured, the fields that did not, the errors."""

    cls: type
    values: dict[str, Any] = attrs.field(factory=dict)
    #: Fields without a valid value: left unset in the section handed to the rules.
    failed: set[str] = attrs.field(factory=set)
    #: Fields holding a section with errors of its own (a ``SectionError.partial``).
    incomplete: set[str] = attrs.field(factory=set)
    errors: Errors = attrs.field(factory=list)

    def structure(self, name: str, value: Any, tp: Any, key: str | None = None) -> None:
        """Structure the field ``name`` from ``value`` as ``tp``, recording the outcome; ``key`` is
        where the value sits in YAML when not at ``name`` (backend options, under the backend's name)."""
        step = name if key is None else key
        try:
            with _at(step):
                self.values[name] = value if tp is None else converter.structure(value, tp)
        except SectionError as exc:
            self.values[name] = exc.partial
            self.incomplete.add(name)
            self.errors += errors_of(exc, step)
        except Exception as exc:
            self.failed.add(name)
            self.errors += errors_of(exc, step)

    def fail(self, name: str, message: str) -> None:
        """Record that the field ``name`` has no valid value, and why."""
        self.failed.add(name)
        self.errors.append((name, message))


def structure_fields(draft: Draft, fields: Iterable[attrs.Attribute], mapping: Mapping[Any, Any]) -> None:
    """Structure each of ``fields`` present in ``mapping`` into ``draft``; a required one absent is an error."""
    for field in fields:
        if field.name in mapping:
            draft.structure(field.name, mapping[field.name], field.type)
        elif field.default is attrs.NOTHING:
            draft.fail(field.name, MISSING_KEY)


def section_mapping(value: Any, cls: type) -> Mapping[str, Any]:
    if value is None:  # ``section:`` with every key commented out
        return {}
    if not isinstance(value, Mapping):
        raise mismatch(f"a mapping of {cls.__name__} keys", value)
    return value


#: Passed to the stand-in of a class for a field that did not structure: set by no default.
_UNSET = object()


def _passing_unset(converter: Any) -> Any:
    """``converter``, except that ``_UNSET`` goes through it unchanged."""
    if converter is None:
        return None
    converter_with_context = getattr(attrs, "Converter", None)  # attrs >= 24.1
    if converter_with_context is not None and isinstance(converter, converter_with_context):
        inner = converter.converter

        def convert_with_context(value: Any, *context: Any) -> Any:
            return value if value is _UNSET else inner(value, *context)

        return converter_with_context(
            convert_with_context, takes_self=converter.takes_self, takes_field=converter.takes_field
        )

    def convert(value: Any) -> Any:
        return value if value is _UNSET else converter(value)

    return convert


def unvalidated_copy(cls: type) -> type:
    """A class with the fields of ``cls`` (defaults, converters, aliases) but no validators or methods.

    Called with the structured values, it fills in the defaults and applies the converters as
    ``cls.__init__`` would, without stopping at the first invalid value.
    """
    fields = {
        field.name: attrs.field(
            default=field.default,
            converter=_passing_unset(field.converter),
            init=field.init,
            alias=field.alias,
            kw_only=field.kw_only,
        )
        for field in attrs.fields(cls)
    }
    return attrs.make_class(cls.__name__, fields, slots=False)


def _field_problem(instance: Any, field: attrs.Attribute) -> tuple[str, str] | None:
    """The error of one field's value: its validator, then, for a registered name, the registry."""
    value = getattr(instance, field.name)
    if field.validator is not None:
        try:
            field.validator(instance, field, value)
        except InvalidValue as exc:
            return exc.field, exc.message
        except AttributeError as exc:
            if not is_unstructured(exc):  # else it reads a field that did not structure: skipped
                return field.name, str(exc)
        except Exception as exc:
            return field.name, str(exc)
    spec = field.metadata.get(names.METADATA_KEY)
    listed = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for name in listed:
        if spec is None or not isinstance(name, str):
            continue
        problem = names.name_problem(names.current_registry(), spec, name)
        if problem is not None:
            return field.name, problem
    return None


def _rule_results(instance: Any, method: str) -> Errors:
    """What ``instance.<method>()`` (``check`` or ``ignored``) yields; nothing from a rule that reads
    a field which did not structure (its own error is reported)."""
    rule: Callable[[], Iterable[tuple[str, str]]] | None = getattr(instance, method, None)
    results: Errors = []
    if callable(rule):
        try:
            results.extend(rule())
        except AttributeError as exc:
            if not is_unstructured(exc):
                raise
    return results


def finish_section(draft: Draft, stand_in: type) -> Any:
    """Validate the drafted section and build it; or raise ``SectionError`` with every error and the
    partial section.

    The validators run one by one on an instance assembled without ``__init__`` (which would stop at
    the first failure); a field that fails is then unset. A registered name is looked up, then the
    class's ``check()`` runs on what is valid. The instance returned is built by ``__init__``.
    (``attrs.validators.disabled()`` would also do, but it switches validators off in every thread.)
    """
    cls = draft.cls
    aliases = {field.name: field.alias for field in attrs.fields(cls) if field.init}
    arguments = {aliases[name]: value for name, value in draft.values.items()}
    arguments.update({aliases[name]: _UNSET for name in draft.failed if name in aliases})
    instance = object.__new__(cls)
    for name, value in vars(stand_in(**arguments)).items():
        if value is not _UNSET:
            object.__setattr__(instance, name, value)
    errors = list(draft.errors)
    for field in attrs.fields(cls):
        if field.name in draft.failed or field.name in draft.incomplete or not hasattr(instance, field.name):
            continue
        problem = _field_problem(instance, field)
        if problem is not None:
            errors.append(problem)
            object.__delattr__(instance, field.name)
    errors += _rule_results(instance, "check")
    if errors:
        raise SectionError(errors, instance)
    for step, message in _rule_results(instance, "ignored"):
        warn_ignored(step, message)
    return attrs.evolve(instance)  # built by ``__init__`` after all, now that its validators pass


def make_section_hook(cls: type[T]) -> Any:
    """Structure ``cls`` from a mapping: each field, then the unknown keys, then ``finish_section``."""
    attrs.resolve_types(cls)  # the field types, for structuring each field
    stand_in = unvalidated_copy(cls)
    fields = [field for field in attrs.fields(cls) if field.init]
    allowed = [field.name for field in fields]

    def structure_section(value: Any, _: type = cls) -> T:
        mapping = section_mapping(value, cls)
        draft = Draft(cls)
        structure_fields(draft, fields, mapping)
        unknown = sorted(str(key) for key in mapping if key not in allowed)
        draft.errors += [(key, unknown_key_message(key, allowed)) for key in unknown]
        return finish_section(draft, stand_in)

    return structure_section


def register_generic_hooks() -> None:
    """Scalars without coercion, containers, and every attrs class as a section."""
    for scalar, hook in (
        (bool, _structure_bool),
        (int, _structure_int),
        (float, _structure_float),
        (str, _structure_str),
    ):
        converter.register_structure_hook(scalar, hook)
    # Later registrations win: the generic attrs hook first, so that the specific ones override it.
    converter.register_structure_hook_factory(attrs.has, make_section_hook)
    converter.register_structure_hook_func(lambda tp: typing.get_origin(tp) is Literal, _structure_literal)
    converter.register_structure_hook_func(_is_optional, _structure_optional)
    converter.register_structure_hook_func(_is_str_or_list, _structure_str_or_list)
    converter.register_structure_hook_func(_is_scalar_union, _structure_scalar_union)
    converter.register_structure_hook_func(
        lambda tp: tp is list or typing.get_origin(tp) is list, _structure_list
    )
    converter.register_structure_hook_func(
        lambda tp: tp is tuple or typing.get_origin(tp) is tuple, _structure_tuple
    )
    converter.register_structure_hook_func(
        lambda tp: tp is dict or typing.get_origin(tp) is dict, _structure_dict
    )
    converter.register_unstructure_hook_func(
        lambda tp: tp is tuple or typing.get_origin(tp) is tuple, _unstructure_tuple
    )


register_generic_hooks()
