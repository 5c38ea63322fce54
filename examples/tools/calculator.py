"""Tools for examples/grpo_tools.yaml: every public function of this file is a tool the model may call
with a Hermes-style block, ``<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>``.
A tool returns a string (or anything JSON can write); raising is answered to the model as an error."""


def multiply(a: int, b: int) -> int:
    """The product of two integers."""
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return int(a) + int(b)
