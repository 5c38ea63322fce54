"""docs/hooks.md describes the hook contract as ``verl_core.hookspecs`` defines it: every hook with its
registry kind and descriptor, every field of every descriptor, and nothing that is not there."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import attrs
import pytest

from verl_core import hookspecs

DOC = (Path(__file__).parents[1] / "docs" / "hooks.md").read_text()
HOOKS = [getattr(hookspecs, name) for name in hookspecs.__all__ if name.startswith(hookspecs.HOOK_PREFIX)]
#: Fields every descriptor has, described once in the page's "Fields every descriptor has" table.
COMMON_FIELDS = {"name", "description", "override"}


def descriptor_of(hook) -> type:
    (descriptor,) = typing.get_args(typing.get_type_hints(hook)["return"])
    return descriptor


def section(hook, doc: str = DOC) -> str:
    """The page's section about ``hook``, from its heading to the next one."""
    match = re.search(rf"^### `{hook.__name__}\(\) -> .*?(?=^### |\Z)", doc, re.M | re.S)
    assert match, f"docs/hooks.md has no section '### `{hook.__name__}() -> ...`'"
    return match.group(0)


def field_mismatch(hook, doc: str = DOC) -> tuple[set[str], set[str]]:
    """``(undocumented fields, documented names that are no field)`` of ``hook``'s descriptor."""
    text = section(hook, doc)
    documented = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    for row in re.findall(r"^\| (`\w+`(?:, `\w+`)+) \|", text, re.M):
        documented |= set(re.findall(r"`(\w+)`", row))
    fields = {field.name for field in attrs.fields(descriptor_of(hook))}
    return fields - COMMON_FIELDS - documented, documented - fields


def test_the_hooks_table_lists_every_hook_with_its_kind_and_descriptor() -> None:
    rows = re.findall(r"^\| `(verl_\w+)\(\)` \| `(\w+)` \| `list\[(\w+)\]` \|", DOC, re.M)
    expected = [
        (h.__name__, h.__name__.removeprefix(hookspecs.HOOK_PREFIX), descriptor_of(h).__name__) for h in HOOKS
    ]
    assert sorted(rows) == sorted(expected)


@pytest.mark.parametrize("hook", HOOKS, ids=lambda hook: hook.__name__)
def test_each_section_documents_every_field_of_its_descriptor(hook) -> None:
    assert field_mismatch(hook) == (set(), set())


def test_a_missing_or_stale_row_is_caught() -> None:
    without = DOC.replace("| `api_version` | `int` |", "| (gone) |", 1)
    stale = DOC.replace(
        "| `devices` | `tuple[str, ...]` | subset", "| `device_list` | `tuple[str, ...]` | subset", 1
    )
    assert field_mismatch(hookspecs.verl_engine_backends, without) == ({"api_version"}, set())
    assert field_mismatch(hookspecs.verl_engine_backends, stale) == ({"devices"}, {"device_list"})


@pytest.mark.parametrize("hook", HOOKS, ids=lambda hook: hook.__name__)
def test_each_spec_says_what_it_returns_when_it_is_called_and_what_failing_does(hook) -> None:
    doc = inspect.getdoc(hook)
    assert f"``{descriptor_of(hook).__name__}``" in doc and ":return:" in doc
    assert "registry is built" in doc and "broken" in doc
    assert not inspect.signature(hook).parameters  # hooks take no arguments, as the page says
