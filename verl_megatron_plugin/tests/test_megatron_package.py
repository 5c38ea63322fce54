"""The installed distribution as a plugin (core's ``PluginContract``), and that it registers no
backend and pulls in no megatron-core before its engine exists."""

from __future__ import annotations

import importlib.metadata

from packaging.requirements import Requirement

from verl_core.testing import PluginContract

DISTRIBUTION = "verl-megatron-plugin"


class TestPlugin(PluginContract):
    distribution = DISTRIBUTION
    package = "verl_megatron"
    entry_points = {}  # an engine-less release declares none: a registered backend must work
    options_examples = {}


def test_pulls_no_megatron_core_until_the_engine_exists():
    requirements = [Requirement(r) for r in importlib.metadata.requires(DISTRIBUTION) or []]
    assert "megatron-core" not in [r.name for r in requirements], (
        f"{DISTRIBUTION} depends on megatron-core but ships no engine that uses it"
    )
