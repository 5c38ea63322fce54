"""The installed distribution as a plugin: core's ``PluginContract`` (version, core range, entry
point, light listing, descriptor, options structure and round trip), and what it pulls in."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from packaging.requirements import Requirement

from verl_core.testing import PluginContract

DISTRIBUTION = "verl-megatron-plugin"


class TestPlugin(PluginContract):
    distribution = DISTRIBUTION
    package = "verl_megatron"
    entry_points = {"megatron": "verl_megatron.plugin"}
    options_examples = {
        "megatron": {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "use_distributed_optimizer": True,
            "transformer_impl": "local",
            "cpu_bridge": True,
        }
    }
    options_docs = {"megatron": Path(__file__).parents[2] / "docs" / "backends" / "megatron.md"}


def test_pulls_in_megatron_core_and_what_it_imports_undeclared():
    requirements = {r.name: r for r in map(Requirement, importlib.metadata.requires(DISTRIBUTION) or [])}
    assert {"megatron-core", "psutil", "einops"} <= set(requirements)
    assert requirements["megatron-core"].specifier.contains("0.16.1")
