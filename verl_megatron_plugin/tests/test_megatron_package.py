"""The installed distribution matches its package, and registers no backend before its engine exists."""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement

import verl_megatron

DISTRIBUTION = "verl-megatron-plugin"


def _requirements() -> list[Requirement]:
    return [Requirement(r) for r in importlib.metadata.requires(DISTRIBUTION) or []]


def test_package_version_matches_distribution_metadata():
    installed = importlib.metadata.version(DISTRIBUTION)
    assert verl_megatron.__version__ == installed, (
        f"verl_megatron.__version__ is {verl_megatron.__version__} but {DISTRIBUTION} is installed as "
        f"{installed}: bump both together (src/verl_megatron/__init__.py and pyproject.toml), then reinstall"
    )


def test_installed_core_is_inside_the_declared_range():
    (core,) = [r for r in _requirements() if r.name == "verl-core"]
    core_version = importlib.metadata.version("verl-core")
    assert core.specifier.contains(core_version), (
        f"{DISTRIBUTION} requires {core} but verl-core {core_version} is installed"
    )


def test_registers_no_backend_and_pulls_no_megatron_until_the_engine_exists():
    entry_points = importlib.metadata.distribution(DISTRIBUTION).entry_points.select(
        group="verl_core.plugins"
    )
    assert not list(entry_points), (
        f"{DISTRIBUTION} declares {list(entry_points)} but ships no engine: a registered backend must work"
    )
    assert "megatron-core" not in [r.name for r in _requirements()], (
        f"{DISTRIBUTION} depends on megatron-core but ships no engine that uses it"
    )
