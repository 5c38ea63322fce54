"""The installed distribution as a plugin: core's ``PluginContract`` (version, core range, entry
point, light listing, descriptor, options structure and round trip)."""

from __future__ import annotations

from pathlib import Path

from verl_core.testing import PluginContract


class TestPlugin(PluginContract):
    distribution = "verl-fsdp-plugin"
    package = "verl_fsdp"
    entry_points = {"fsdp": "verl_fsdp.plugin"}
    options_examples = {
        "fsdp": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "shard_modules": ["Qwen2DecoderLayer"]}
    }
    options_docs = {"fsdp": Path(__file__).parents[2] / "docs" / "backends" / "fsdp.md"}
