"""The DDP plugin as a plugin: discovery through its entry point, a light plugin module, its options,
and the engine's own guards. (What the engine computes is the conformance kit's job.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from verl_core.config import EngineConfig, ModelConfig, structure
from verl_core.engine import build_engine
from verl_core.engine.checkpoint import CheckpointError, atomic_checkpoint
from verl_core.errors import ConfigError
from verl_core.plugins import Registry
from verl_core.testing.tiny import collate, make_samples, save_tiny_models

from verl_ddp.config import DDPConfig
from verl_ddp.engine import DDPEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def registry() -> Registry:
    """What a user gets: built-ins plus installed entry points, nothing passed by hand."""
    return Registry.from_plugins(autoload=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_models(tmp_path_factory.mktemp("tiny")).lm


def test_backend_is_discovered_through_the_entry_point(registry) -> None:
    backend = registry.get("engine_backends", "ddp")
    assert backend.load_engine() is DDPEngine and backend.load_config() is DDPConfig
    assert backend.roles == ("lm", "value") and backend.devices == ("cpu", "cuda")
    (entry,) = [entry for entry in registry.entries("engine_backends") if entry.name == "ddp"]
    assert (entry.plugin, entry.distribution, entry.version, entry.status) == (
        "ddp",
        "verl-ddp",
        "0.1.0",
        "ok",
    )


def test_listing_the_plugin_does_not_import_torch() -> None:
    script = (
        "import sys\n"
        "from verl_core.plugins import get_registry\n"
        "backend = get_registry().get('engine_backends', 'ddp')\n"
        "assert backend.engine == 'verl_ddp.engine:DDPEngine', backend\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'verl_ddp.engine') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_options_come_from_the_backend_section_of_a_config(registry) -> None:
    data = {"backend": "ddp", "model": {"path": "m"}, "ddp": {"bucket_cap_mb": 8, "static_graph": True}}
    engine_config = structure(data, EngineConfig, "actor.engine", registry=registry)
    assert engine_config.options == DDPConfig(bucket_cap_mb=8.0, static_graph=True)

    typo = {"backend": "ddp", "model": {"path": "m"}, "ddp": {"bucket_cap_mbb": 8}}
    with pytest.raises(ConfigError, match=r"actor\.engine\.ddp\.bucket_cap_mbb: unknown key"):
        structure(typo, EngineConfig, "actor.engine", registry=registry)


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="'bucket_cap_mb' must be > 0: 0"):
        DDPConfig(bucket_cap_mb=0)


def test_engine_refuses_foreign_options_and_use_before_initialize(model_dir) -> None:
    with pytest.raises(
        ConfigError, match=r"engine\.options: expected an instance of verl_ddp\.config\.DDPConfig.*got builtins\.dict"
    ):
        DDPEngine(
            EngineConfig(backend="ddp", model=ModelConfig(path=model_dir), options={"static_graph": True})
        )
    engine = DDPEngine(EngineConfig(backend="ddp", model=ModelConfig(path=model_dir)))
    with pytest.raises(RuntimeError, match=r"not initialised: call initialize\(\) first"):
        engine.infer_batch(collate(make_samples(0)[:2]))


def test_single_process_engine_is_unwrapped_on_the_configured_device(registry, model_dir) -> None:
    config = EngineConfig(backend="ddp", model=ModelConfig(path=model_dir), device="auto")
    engine = build_engine(config, registry=registry)
    engine.initialize()
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine.model is engine.module and engine.device.type == expected_device
    assert {p.device.type for p in engine.module.parameters()} == {expected_device}
    with pytest.raises(RuntimeError, match="already called"):
        engine.initialize()


def test_checkpoint_of_another_backend_is_refused(registry, model_dir, tmp_path) -> None:
    engine = build_engine(EngineConfig(backend="ddp", model=ModelConfig(path=model_dir)), registry=registry)
    engine.initialize()
    with atomic_checkpoint(tmp_path / "fsdp_ckpt", global_step=4, backend="fsdp"):
        pass
    with pytest.raises(
        CheckpointError, match=r"saved by engine backend 'fsdp'.*resume with engine\.backend=fsdp"
    ):
        engine.load_checkpoint(str(tmp_path / "fsdp_ckpt"))
