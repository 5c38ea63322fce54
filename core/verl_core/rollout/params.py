"""``SamplingParams``: how one generation samples (a light module: requests and the batch call share it)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import attrs


def _sampling_rule(description: str, accept: Callable[[Any], bool]) -> Callable[[Any, Any, Any], None]:
    """An attrs validator refusing what ``accept`` does not (and booleans, which are ints to Python),
    with a ``ValueError`` naming the field and what it must be."""

    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not accept(value):
            raise ValueError(f"SamplingParams.{attribute.name}={value!r}: must be {description}")

    return validate


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def _is_number(value: Any, low: float, high: float = math.inf, *, include_low: bool = True) -> bool:
    return (
        isinstance(value, numbers.Real)
        and math.isfinite(value)
        and (value >= low if include_low else value > low)
        and value <= high
    )


@attrs.frozen
class SamplingParams:
    """How one ``generate`` call samples.

    ``temperature=0`` is greedy decoding (its log-probs are those of the untempered distribution);
    ``top_k=0`` and ``top_p=1`` disable the filters. Generation stops at any of ``eos_token_ids`` or
    after ``max_new_tokens``. Every field is checked on construction (a ``ValueError`` naming it): a
    negative temperature would sample the inverted distribution, and ``top_p=0`` keep no token.
    """

    max_new_tokens: int = attrs.field(
        validator=_sampling_rule("an int >= 1: the most tokens a response may have", lambda v: _is_int(v, 1))
    )
    eos_token_ids: tuple[int, ...] = attrs.field(
        validator=_sampling_rule(
            "a tuple of token ids (ints >= 0); () for none",
            lambda ids: isinstance(ids, (tuple, list)) and all(_is_int(i, 0) for i in ids),
        )
    )
    pad_token_id: int = attrs.field(
        validator=_sampling_rule("a token id, an int >= 0", lambda v: _is_int(v, 0))
    )
    temperature: float = attrs.field(
        default=1.0,
        validator=_sampling_rule("a finite number >= 0 (0: greedy decoding)", lambda v: _is_number(v, 0)),
    )
    top_k: int = attrs.field(
        default=0,
        validator=_sampling_rule(
            "an int >= 0: sample among the top_k most likely tokens, 0 for all of them (vLLM's -1)",
            lambda v: _is_int(v, 0),
        ),
    )
    top_p: float = attrs.field(
        default=1.0,
        validator=_sampling_rule(
            "a number in (0, 1]: the probability mass sampled from, 1 for all of it",
            lambda v: _is_number(v, 0, 1, include_low=False),
        ),
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
