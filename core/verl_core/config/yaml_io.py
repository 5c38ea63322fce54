"""The YAML dialect of config files and overrides: PyYAML's safe loader with YAML 1.2 scalars.

YAML 1.1 (PyYAML's default) reads ``1e-5`` as a string, ``on``/``no`` as booleans and ``1_2`` as the
integer 12 (``0_5_2`` as 42, ``1:30`` as 90); here, as in YAML 1.2, ``1e-5`` is a float, only
``true``/``false`` are booleans and integers are digits (``0x``/``0o`` prefixed too), so that a
``"low_high"`` bound such as ``0.5_2`` or ``1_2`` stays the string it looks like. Duplicate keys are errors
instead of silently keeping the last. What ``dump`` writes, ``load`` reads back unchanged, and so
does a YAML 1.1 reader.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from verl_core.errors import ConfigError

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"


def _yaml12_resolvers() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    """PyYAML's implicit types, with YAML 1.2's booleans, integers and floats."""
    resolvers = {
        first: [(tag, pattern) for tag, pattern in candidates if tag not in (_BOOL, _INT, _FLOAT)]
        for first, candidates in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    booleans = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
    integers = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
    floats = re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    )
    for first in "tTfF":
        resolvers.setdefault(first, []).append((_BOOL, booleans))
    for first in "-+0123456789":
        resolvers.setdefault(first, []).append((_INT, integers))
    for first in "-+0123456789.":  # after the integer resolvers: "12" stays an int
        resolvers.setdefault(first, []).append((_FLOAT, floats))
    return resolvers


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2's integers: ``012`` is twelve (YAML 1.1 reads an octal 10)."""
    text = loader.construct_scalar(node)
    if text.startswith(("0x", "0o")):
        return int(text, 0)
    return int(text, 10)


class _Loader(yaml.SafeLoader):
    yaml_implicit_resolvers = _yaml12_resolvers()
    yaml_constructors = {**yaml.SafeLoader.yaml_constructors, _INT: _construct_int}

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE:
                if key_node.value in seen:
                    raise ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"duplicate key '{key_node.value}'",
                        key_node.start_mark,
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


class _Dumper(yaml.SafeDumper):
    # Quotes every string that ``_Loader`` or a YAML 1.1 reader (``yaml.safe_load``) would read as
    # another type: the output means the same to both.
    yaml_implicit_resolvers = {
        first: [
            *yaml.SafeDumper.yaml_implicit_resolvers.get(first, []),
            *_Loader.yaml_implicit_resolvers.get(first, []),
        ]
        for first in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Loader.yaml_implicit_resolvers}
    }


def syntax_error_message(error: yaml.YAMLError) -> str:
    """``YAML syntax error at line 3, column 7: mapping values are not allowed here``."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(error, "context", None)
    context_mark = getattr(error, "context_mark", None)
    if context and context_mark is not None:
        problem += f" ({context} started at line {context_mark.line + 1})"
    return f"YAML syntax error{where}: {problem}"


def load(text: str) -> Any:
    """Parse YAML text (``yaml.YAMLError`` on bad syntax; see ``syntax_error_message``)."""
    return yaml.load(text, Loader=_Loader)


def load_file(path: str) -> dict[str, Any]:
    """The mapping in the YAML file ``path``; an empty file is ``{}``.

    Raises ``ConfigError`` naming the file (and the line, for a syntax error; the byte offset, for a
    file that is not UTF-8).
    """
    try:
        with open(path, encoding="utf-8") as stream:
            data = load(stream.read())
    except OSError as exc:
        raise ConfigError(
            [("", f"cannot read the config file: {exc.strerror or exc}")], source=path
        ) from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start : exc.start + 1].hex()
        message = (
            f"the config file is not UTF-8 text: byte 0x{byte} at offset {exc.start} is not valid UTF-8 "
            f"({exc.reason}); save the file as UTF-8"
        )
        raise ConfigError([("", message)], source=path) from None
    except yaml.YAMLError as exc:
        raise ConfigError([("", syntax_error_message(exc))], source=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        message = (
            f"expected a mapping of sections (actor:, data:, ...) at the top level, got {type(data).__name__}"
        )
        raise ConfigError([("", message)], source=path)
    return data


def dump(data: Any) -> str:
    """YAML text for plain data, in block style, keys in their given order.

    Non-ASCII characters are written as escapes: PyYAML would write some (``\\x85``) raw and then
    read them as line breaks.
    """
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
