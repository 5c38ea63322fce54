"""The DDP plugin as a plugin (core's ``PluginContract``: entry point, light listing, descriptor,
options), and what only this engine does. What the engine computes is the conformance kit's job
(test_conformance.py)."""

from __future__ import annotations

import pytest
import torch
from verl_core.config import EngineConfig, ModelConfig
from verl_core.engine import build_engine
from verl_core.plugins import Registry
from verl_core.testing import PluginContract, save_tiny_models

from verl_ddp.config import DDPConfig

torch.set_num_threads(1)


class TestPlugin(PluginContract):
    distribution = "verl-ddp"
    package = "verl_ddp"
    entry_points = {"ddp": "verl_ddp.plugin"}
    options_examples = {"ddp": {"bucket_cap_mb": 8, "static_graph": True}}


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="'bucket_cap_mb' must be > 0: 0"):
        DDPConfig(bucket_cap_mb=0)


def test_a_single_process_runs_the_unwrapped_model_on_the_configured_device(tmp_path) -> None:
    config = EngineConfig(backend="ddp", model=ModelConfig(path=save_tiny_models(tmp_path).lm), device="auto")
    engine = build_engine(config, registry=Registry.from_plugins(autoload=True))
    engine.initialize()
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.model is engine.module and engine.device.type == expected_device
    assert {p.device.type for p in engine.module.parameters()} == {expected_device}
    with pytest.raises(RuntimeError, match="already called"):
        engine.initialize()
