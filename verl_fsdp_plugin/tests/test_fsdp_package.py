"""The installed distribution matches its package and registers the ``fsdp`` backend by its entry point."""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement

import verl_fsdp

DISTRIBUTION = "verl-fsdp-plugin"


def test_package_version_matches_distribution_metadata():
    installed = importlib.metadata.version(DISTRIBUTION)
    assert verl_fsdp.__version__ == installed, (
        f"verl_fsdp.__version__ is {verl_fsdp.__version__} but {DISTRIBUTION} is installed as {installed}: "
        "bump both together (src/verl_fsdp/__init__.py and pyproject.toml), then reinstall"
    )


def test_installed_core_is_inside_the_declared_range():
    requirements = [Requirement(r) for r in importlib.metadata.requires(DISTRIBUTION) or []]
    (core,) = [r for r in requirements if r.name == "verl-core"]
    core_version = importlib.metadata.version("verl-core")
    assert core.specifier.contains(core_version), (
        f"{DISTRIBUTION} requires {core} but verl-core {core_version} is installed"
    )


def test_registers_the_fsdp_backend_through_one_entry_point():
    entry_points = importlib.metadata.distribution(DISTRIBUTION).entry_points.select(
        group="verl_core.plugins"
    )
    assert [(ep.name, ep.value) for ep in entry_points] == [("fsdp", "verl_fsdp.plugin")], (
        f"{DISTRIBUTION} declares {list(entry_points)}; expected fsdp = verl_fsdp.plugin "
        "(reinstall with pip install -e verl_fsdp_plugin after editing pyproject.toml)"
    )
