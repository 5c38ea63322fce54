"""Tool calls in the model's text, Hermes style (Qwen2.5, Hermes, most open instruct models)::

    <tool_call>
    {"name": "multiply", "arguments": {"a": 12, "b": 34}}
    </tool_call>

A reply may hold several calls. Parsing never raises: a call that cannot be run (an unclosed tag,
JSON that does not parse, no ``name``, ``arguments`` that are not an object) becomes a ``problem``
that the environment returns to the model as an error message, so that it can learn to call tools
correctly instead of ending the run.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"(.*?)(?:" + re.escape(CLOSE_TAG) + r"|$)", re.DOTALL)


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
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return (
            None,
            f"tool call {number} is not valid JSON ({error.msg} at character {error.pos}); {expected}",
        )
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, f"tool call {number} has no string 'name'; {expected}"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return None, f"tool call {number} ({value['name']}): 'arguments' is not an object; {expected}"
    return ToolCall(value["name"], arguments), None
