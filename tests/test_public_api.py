"""The public API is pinned: a name that disappears or a signature that changes incompatibly fails here,
naming the fix; added names and optional keyword arguments pass.

The committed snapshot (tests/fixtures/public_api.json) is compared with the API as it is now
(``fixtures.public_api``). Each way of breaking it is shown to fail by changing the live API on purpose.
"""

from __future__ import annotations

import abc
import importlib
import sys

import pytest
from fixtures import public_api
from hypothesis import given
from hypothesis import strategies as st

import verl_core
from verl_core.deprecation import DEPRECATIONS, VerlCoreRemovedIn04Warning


@pytest.fixture(scope="module")
def recorded() -> dict:
    return public_api.load()


def problems_now(recorded: dict, version: str = verl_core.__version__) -> list[str]:
    return public_api.incompatibilities(recorded, public_api.snapshot(), version)


def test_the_live_api_keeps_every_recorded_name_and_signature(recorded) -> None:
    problems = problems_now(recorded)
    assert not problems, "\n".join(["the public API changed incompatibly:", *problems, public_api.FIX])


def test_docs_api_lists_every_recorded_name(recorded) -> None:
    doc = public_api.API_DOC.read_text()
    start, end = doc.index(public_api.DOC_START), doc.index(public_api.DOC_END) + len(public_api.DOC_END)
    assert doc[start:end] == public_api.reference_section(recorded), (
        "docs/api.md's reference section is not the recorded API: run `python tests/fixtures/public_api.py --update`"
    )


def test_every_declared_deprecation_is_recorded(recorded) -> None:
    """A deprecation added without updating the snapshot would never be checked for its removal date."""
    public_api.import_everything()
    recorded_whats = set()
    for path, entry in recorded.items():
        if "deprecated" in entry:
            module, _, name = path.removeprefix("(deprecated) ").partition(":")
            recorded_whats |= {module, f"{module}.{name}"}
    missing = sorted(set(DEPRECATIONS) - recorded_whats)
    assert not missing, (
        f"deprecations not in the snapshot: {missing}; run `python tests/fixtures/public_api.py --update`"
    )


def test_each_public_name_has_one_home(recorded) -> None:
    """No object is public under two paths (a silent re-export, frozen there): the modules behind the
    faces are not listed, and a name that moved is a deprecated alias, not a second home."""
    homes: dict[int, list[str]] = {}
    for path, obj, deprecation in public_api.live_entries():
        public = deprecation is None and obj is not None and not path.startswith("(deprecated)")
        if public and not isinstance(obj, str | int | float | bool | tuple | frozenset):  # values may repeat
            homes.setdefault(id(obj), []).append(path)
    shared = {paths[0]: paths for paths in homes.values() if len(paths) > 1}
    assert not shared, f"public under several paths: {shared}"


def test_every_deprecated_alias_warns_with_its_removal_class_and_gives_the_new_object(recorded) -> None:
    public_api.import_everything()
    checked = 0
    for path, entry in recorded.items():
        if "deprecated" not in entry or path.startswith("(deprecated)"):
            continue
        module_name, _, name = path.partition(":")
        module = importlib.import_module(module_name)
        with pytest.warns(VerlCoreRemovedIn04Warning, match=r"use verl_core\.") as caught:
            old = getattr(module, name)
        deprecation = DEPRECATIONS.get(f"{module_name}.{name}") or DEPRECATIONS[module_name]
        assert entry["deprecated"]["removed_in"] == deprecation.removed_in == "0.4.0"
        replacement = deprecation.replacement
        if (
            replacement.startswith("verl_core.")
            and " " not in replacement
            and deprecation.what != module_name
        ):
            new_module, _, new_name = replacement.rpartition(".")
            try:
                new = getattr(importlib.import_module(new_module), new_name)
            except ModuleNotFoundError:  # Class.member: the member of a class
                owner_module, _, owner = new_module.rpartition(".")
                new = getattr(getattr(importlib.import_module(owner_module), owner), new_name)
            assert old is new, f"{path} gives {old!r}, its replacement {replacement} is {new!r}"
        assert str(caught[0].filename).endswith("test_public_api.py")  # at the line that used it
        checked += 1
    assert checked > 50


# -- each way of breaking the API fails -------------------------------------------------------------


def test_a_removed_public_name_fails_with_the_fix(recorded, monkeypatch) -> None:
    import verl_core.engine as engine

    monkeypatch.setattr(engine, "__all__", [name for name in engine.__all__ if name != "build_engine"])
    monkeypatch.delitem(engine._EXPORTS, "build_engine")
    problems = problems_now(recorded)
    # Still defined in its module, but the face is the one promise.
    assert importlib.import_module("verl_core.engine.factory").build_engine
    assert "verl_core.engine:build_engine: removed" in problems


def test_a_new_required_parameter_fails(recorded, monkeypatch) -> None:
    factory = importlib.import_module("verl_core.engine.factory")

    def build_engine(config, role="lm", registry=None, *, config_path="engine", seed): ...

    monkeypatch.setattr(factory, "build_engine", build_engine)
    problems = problems_now(recorded)
    assert (
        "verl_core.engine:build_engine: new required parameter 'seed': existing calls do not pass it"
        in problems
    )


def test_an_optional_keyword_and_a_new_name_pass(recorded, monkeypatch) -> None:
    factory = importlib.import_module("verl_core.engine.factory")
    import verl_core.engine as engine

    def build_engine(config, role="lm", registry=None, *, config_path="engine", seed=0): ...

    monkeypatch.setattr(factory, "build_engine", build_engine)
    monkeypatch.setitem(engine._EXPORTS, "brand_new", "verl_core.engine.factory")
    monkeypatch.setattr(engine, "__all__", [*engine.__all__, "brand_new"])
    monkeypatch.setattr(factory, "brand_new", lambda: None, raising=False)
    assert problems_now(recorded) == []
    assert "verl_core.engine:brand_new" in public_api.additions(recorded, public_api.snapshot())


def test_a_new_abstract_method_of_an_extension_point_fails(recorded, monkeypatch) -> None:
    from verl_core.engine import BaseEngine

    monkeypatch.setattr(BaseEngine, "sync_weights", abc.abstractmethod(lambda self: None), raising=False)
    problems = problems_now(recorded)
    assert any(
        p.startswith("verl_core.engine:BaseEngine: new abstract method sync_weights: every existing subclass")
        for p in problems
    ), problems


def test_an_optional_parameter_on_an_overridable_method_fails(recorded, monkeypatch) -> None:
    """What broke plugins in 0.2: core passing a new argument to a method that subclasses override."""
    from verl_core.engine import BaseEngine

    def save_checkpoint(self, path, global_step=0, *, keep=1): ...

    monkeypatch.setattr(BaseEngine, "save_checkpoint", abc.abstractmethod(save_checkpoint))
    problems = problems_now(recorded)
    assert any("method save_checkpoint: parameters changed" in p for p in problems), problems


def test_removing_a_deprecated_alias_before_its_release_fails(recorded, monkeypatch) -> None:
    public_api.import_everything()
    monkeypatch.delitem(DEPRECATIONS, "verl_core.engine.distributed")
    monkeypatch.setitem(sys.modules, "verl_core.engine.distributed", None)  # as if its file were gone
    problems = problems_now(recorded)
    assert (
        "verl_core.engine.distributed:barrier: removed before its announced removal in 0.4.0" in problems
    ), problems


def test_a_deprecation_past_its_removal_release_fails(recorded) -> None:
    problems = public_api.incompatibilities(recorded, public_api.snapshot(), "0.4.0")
    assert any(
        p.startswith("verl_core.engine.distributed:barrier: deprecated since 0.2.0 for removal in 0.4.0")
        for p in problems
    ), problems


def test_a_changed_batch_key_fails(recorded, monkeypatch) -> None:
    monkeypatch.setattr(importlib.import_module("verl_core.data.batch"), "RESPONSE_MASK", "loss_mask")
    assert "verl_core.data:RESPONSE_MASK: value changed from 'response_mask' to 'loss_mask'" in problems_now(
        recorded
    )


# -- the signature rule, on random signatures --------------------------------------------------------

KINDS = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")


@st.composite
def signatures(draw) -> list[list]:
    names = draw(st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=6))
    positional = draw(st.integers(0, len(names)))
    params, defaulted = [], False
    for index, name in enumerate(names):
        kind = KINDS[0] if index < positional else KINDS[1]
        # Python requires defaults to trail among positional parameters.
        default = draw(st.booleans()) or (defaulted and kind == KINDS[0])
        defaulted |= default and kind == KINDS[0]
        params.append([name, kind, default])
    return params


@given(signatures(), st.sampled_from("xyz"), st.booleans())
def test_appending_an_optional_keyword_or_kwargs_is_compatible(old, name, kwargs) -> None:
    new = [*old, [name, "KEYWORD_ONLY", True]] + ([["kw", "VAR_KEYWORD", False]] if kwargs else [])
    assert public_api.signature_changes(old, new, strict=False) == []


@given(signatures(), st.data())
def test_removing_a_parameter_or_its_default_or_adding_a_required_one_is_not(old, data) -> None:
    mutation = data.draw(st.sampled_from(["remove", "no_default", "required"]))
    new = [list(p) for p in old]
    if mutation == "required":
        new.append(["z", "KEYWORD_ONLY", False])
    else:
        candidates = [p for p in new if p[2]] if mutation == "no_default" else new
        if not candidates:
            return
        victim = data.draw(st.sampled_from(candidates))
        if mutation == "remove":
            new.remove(victim)
        else:
            victim[2] = False
    assert public_api.signature_changes(old, new, strict=False) != []


@given(signatures())
def test_swapping_two_positional_parameters_is_not(old) -> None:
    positional = [i for i, p in enumerate(old) if p[1] == "POSITIONAL_OR_KEYWORD"]
    if len(positional) < 2:
        return
    new = [list(p) for p in old]
    i, j = positional[:2]
    new[i][0], new[j][0] = new[j][0], new[i][0]
    assert public_api.signature_changes(old, new, strict=False) != []
