"""Field validators for config classes, with messages that say what a valid value is.

They are ordinary attrs validators (``attrs.field(validator=positive)``), so a config built in Python
is checked on construction and on assignment. ``verl_core.config.structure`` runs them one by one
after structuring and reports each failure at the field's full dotted path, all at once; backend
config classes of plugins may use them too.

Rules that relate several fields belong in a ``check()`` method of the class instead (see
docs/config.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

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
#: A string with at least one character: paths, names.
non_empty = _bound("non-empty", lambda value: len(value) > 0)
