"""docs/engine.md documents the whole engine contract and toolkit: every abstract and public method
and property of ``BaseEngine``, the hooks of ``HFEngine``, every name ``verl_core.engine`` exports,
and every key of the batch contract."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import verl_core.engine
from verl_core.data import batch as keys
from verl_core.engine import BaseEngine
from verl_core.toolkit import HFEngine

DOC = (Path(__file__).parents[1] / "docs" / "engine.md").read_text()


def documented(name: str) -> bool:
    """``name`` appears as code: `name`, `name(...)` or `Class.name` in backticks."""
    return re.search(rf"`(?:\w+\.)?{re.escape(name)}(?:[`(\[ ]|$)", DOC) is not None


def public_members(cls: type, below: type | None = None) -> list[str]:
    inherited = set(dir(below)) if below else set()
    return sorted(
        name
        for name, _ in inspect.getmembers(cls)
        if not name.startswith("_") and name not in inherited and name not in ("register", "abc")
    )


@pytest.mark.parametrize("name", sorted(BaseEngine.__abstractmethods__))
def test_every_abstract_method_is_documented(name: str) -> None:
    assert documented(name), f"docs/engine.md does not document BaseEngine.{name}"


@pytest.mark.parametrize("name", public_members(BaseEngine))
def test_every_public_member_of_the_contract_is_documented(name: str) -> None:
    assert documented(name), f"docs/engine.md does not document BaseEngine.{name}"


@pytest.mark.parametrize("name", ["wrap_model", "no_sync", "move_model", "full_tensor", "optimizer_device"])
def test_every_hook_of_the_hf_engine_is_documented(name: str) -> None:
    assert hasattr(HFEngine, name) or name in HFEngine.__init__.__code__.co_names
    assert documented(name), f"docs/engine.md does not document HFEngine.{name}"


@pytest.mark.parametrize("name", verl_core.engine.__all__)
def test_every_exported_toolkit_name_is_documented(name: str) -> None:
    assert documented(name), f"docs/engine.md does not document verl_core.engine.{name}"


BATCH_CONSTANTS = {
    name: value for name, value in vars(keys).items() if name.isupper() and isinstance(value, str)
}


@pytest.mark.parametrize("name", sorted(BATCH_CONSTANTS))
def test_every_batch_key_is_documented_with_its_constant(name: str) -> None:
    row = f"| `{name}` | `{BATCH_CONSTANTS[name]}` |"
    assert row in DOC, f"docs/engine.md's batch contract has no row {row!r}"


def test_the_check_sees_an_undocumented_name() -> None:
    assert not documented("no_such_method_anywhere")
