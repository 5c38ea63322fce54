"""Tool calls in the model's text, Hermes style (Qwen2.5, Hermes, most open instruct models)::

    <tool_call>
    {"name": "multiply", "arguments": {"a": 12, "b": 34}}
    </tool_call>

A reply may hold several calls. Parsing never raises, whatever the text: a call that cannot be run
(an unclosed tag, JSON that does not parse, no ``name``, ``arguments`` that are not an object) becomes
a ``problem`` that the environment returns to the model as an error message, so that it can learn to
call tools correctly instead of ending the run. JSON that Python's parser would take but that is no
JSON text (``NaN``, ``Infinity``, a lone surrogate ``"\\ud800"``, which no tokenizer can encode when a
tool echoes it), nests deeper than the parser recurses or holds an integer longer than Python converts
(``sys.get_int_max_str_digits()``) does not parse either.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|$)", re.DOTALL)
#: Half a UTF-16 surrogate pair: no UTF-8 text (nothing a tokenizer encodes) holds one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@attrs.frozen
class ToolCall:
    """One well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@attrs.frozen
class ParsedReply:
    """The calls of one reply in order, and what was wrong with each malformed one."""

    calls: tuple[ToolCall, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def has_calls(self) -> bool:
        """Whether the model tried to call a tool at all (well-formed or not)."""
        return bool(self.calls or self.problems)


def parse_tool_calls(text: str) -> ParsedReply:
    """Every ``<tool_call>...</tool_call>`` block of ``text``."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    for number, match in enumerate(_CALL.finditer(text), start=1):
        body = match.group(1).strip()
        closed = match.group(0).endswith(CLOSE_TAG)
        problem = None if closed else f"tool call {number} has no closing {CLOSE_TAG}"
        call = None
        if problem is None:
            call, problem = _parse_call(number, body)
        if call is not None:
            calls.append(call)
        else:
            problems.append(problem)
    return ParsedReply(tuple(calls), tuple(problems))


def _parse_call(number: int, body: str) -> tuple[ToolCall | None, str | None]:
    expected = 'expected {"name": "<tool>", "arguments": {...}}'
    value, error = _loads(body)
    if error is not None:
        return None, f"tool call {number} is not valid JSON ({error}); {expected}"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, f"tool call {number} has no string 'name'; {expected}"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        decoded, error = _loads(arguments)
        arguments = arguments if error is not None else decoded
    if not isinstance(arguments, dict):
        return None, f"tool call {number} ({value['name']}): 'arguments' is not an object; {expected}"
    return ToolCall(value["name"], arguments), None


def _loads(text: str) -> tuple[Any, str | None]:
    """``text`` as JSON, or why it is none (for the model: short, without Python's advice)."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as error:
        return None, f"{error.msg} at character {error.pos}"
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as error:  # an integer past int's string-conversion limit; NaN, Infinity
        return None, str(error) if isinstance(error, _NotJSON) else "a number with too many digits"
    except Exception as error:  # noqa: BLE001 - whatever else json raises is the text's fault too
        return None, f"{type(error).__name__}: {error}"
    surrogate = _lone_surrogate(value)
    if surrogate is not None:
        return None, f"a lone surrogate {surrogate!r} in a string"
    return value, None


class _NotJSON(ValueError):
    """A value Python's JSON parser accepts but JSON has not."""


def _no_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJSON(f"{text} is too large for a number")
    return value


def _lone_surrogate(value: Any) -> str | None:
    """The first string character of ``value`` (keys included) that is half a UTF-16 surrogate pair,
    which no UTF-8 text holds; walked without recursion (the value may nest a thousand deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            found = LONE_SURROGATE.search(item)
            if found:
                return found.group()
    return None
