"""Field validators for config classes, with messages that say what a valid value is.

They are ordinary attrs validators (``attrs.field(validator=positive)``), so a config built in Python
is checked on construction and on assignment. ``verl_core.config.structure`` runs them one by one
after structuring and reports each failure at the field's full dotted path, all at once; backend
config classes of plugins may use them too.

Rules that relate several fields belong in a ``check()`` method of the class instead (see
docs/config.md); ``each_rule`` runs several independent rules so that one whose inputs did not
structure does not stop the others.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from verl_core.descriptors import DEVICES
from verl_core.errors import did_you_mean

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


class InvalidValue(ValueError):
    """A field holds a value outside its allowed range.

    ``field`` is the path of the bad value inside its class (``betas[1]``); ``message`` omits it.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _bound(description: str, accept: Callable[[Any], bool]) -> Validator:
    # ``None`` passes: Optional fields use ``None`` for "off", and their type is checked elsewhere.
    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not accept(value):
            raise InvalidValue(attribute.name, f"must be {description}, got {value!r}")

    return validate


def greater_than(bound: float) -> Validator:
    """Require ``value > bound``."""
    return _bound(f"> {bound}", lambda value: value > bound)


def at_least(bound: float) -> Validator:
    """Require ``value >= bound``."""
    return _bound(f">= {bound}", lambda value: value >= bound)


def in_range(low: float, high: float, *, include_low: bool = True, include_high: bool = True) -> Validator:
    """Require ``low <= value <= high``; ``include_low`` / ``include_high`` make either end open."""
    left, right = ("[" if include_low else "("), ("]" if include_high else ")")

    def accept(value: float) -> bool:
        above = value >= low if include_low else value > low
        below = value <= high if include_high else value < high
        return above and below

    return _bound(f"in {left}{low}, {high}{right}", accept)


def each(validator: Validator) -> Validator:
    """Apply ``validator`` to every item of a list or tuple; a failure names the item's index."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], values: Any) -> None:
        for index, value in enumerate(values):
            try:
                validator(instance, attribute, value)
            except InvalidValue as error:
                raise InvalidValue(f"{attribute.name}[{index}]", error.message) from None

    return validate


#: ``> 0``: sizes, counts, lengths, learning rates.
positive = greater_than(0)
#: ``>= 0``: coefficients, step counts where 0 means "off".
non_negative = at_least(0)
#: ``[0, 1]``: discount factors, ratios.
unit_interval = in_range(0, 1)
#: Neither infinite nor NaN (a NaN fails every comparison, so bounds alone would let it through).
finite = _bound("finite", math.isfinite)
#: A string with at least one character: paths, names.
non_empty = _bound("non-empty", lambda value: len(value) > 0)


def one_of(names: Iterable[str], what: str, note: str = "") -> Validator:
    """Require one of ``names``; the message names ``what`` is unknown, the close match and the choices.

    ``note`` follows the list of choices (``each also with a '+' suffix``). Unlike a ``Literal`` type,
    the message can say what the names mean; use it for long or open-ended lists of names.
    """
    choices = tuple(names)

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise InvalidValue(attribute.name, unknown_choice_message(what, value, choices, note))

    return validate


def unknown_choice_message(what: str, value: Any, choices: Iterable[str], note: str = "") -> str:
    """``unknown KL estimator 'k4' (did you mean 'k1'?); use one of kl, k1, ...``."""
    choices = list(choices)
    listed = ", ".join(choices) + (f"; {note}" if note else "")
    return f"unknown {what} {value!r}{did_you_mean(value, choices)}; use one of {listed}"


#: What a ``device`` option accepts, as its messages list it: ``auto`` and the device types of
#: ``verl_core.descriptors.DEVICES``, ``cuda`` also with a GPU index (``cuda:N``).
DEVICE_NAMES: tuple[str, ...] = (
    "auto",
    *(name for kind in DEVICES for name in ((kind, "cuda:N") if kind == "cuda" else (kind,))),
)
_DEVICE = re.compile("|".join(["auto", *map(re.escape, DEVICES), r"cuda:\d+"]))


def device(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Require a device an engine can compute on: ``auto`` (``cuda`` when available, else ``cpu``),
    a device type of ``verl_core.descriptors.DEVICES``, or ``cuda:N``. Checked without importing
    torch: whether the device exists on this machine is checked when the engine is built."""
    if not (isinstance(value, str) and _DEVICE.fullmatch(value)):
        raise InvalidValue(attribute.name, unknown_choice_message("device", value, DEVICE_NAMES))


def is_unstructured(error: BaseException) -> bool:
    """Whether ``error`` is the ``AttributeError`` of reading a field that did not structure.

    A section with errors is still handed to the rules of the sections around it, holding only the
    fields whose values are valid; a rule that reads one of the others raises this. Its inputs'
    errors are reported already, so the rule is skipped rather than run on a guess.
    """
    owner = getattr(error, "obj", None)
    return (
        isinstance(error, AttributeError)
        and attrs.has(type(owner))
        and getattr(error, "name", None) in attrs.fields_dict(type(owner))
    )


def each_rule(*rules: Callable[[], Iterable[tuple[str, str]]]) -> Iterator[tuple[str, str]]:
    """What a ``check()`` of several independent rules yields: each rule's ``(path, message)`` pairs.

    A rule that reads a field which did not structure (see ``is_unstructured``) is skipped, and the
    next one still runs: ``RunConfig.check`` reports the mini-batch rule even when ``algorithm``
    has an error of its own.
    """
    for rule in rules:
        try:
            yield from rule()
        except AttributeError as error:
            if not is_unstructured(error):
                raise
