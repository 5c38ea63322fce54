"""The FSDP plugin as a plugin, and everything that runs in one process without a process group:
discovery through the entry point, a light plugin module, the options (structuring, validation, round
trip), the layout's configuration errors, the engine's guards, and the unsharded single-process path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from verl_core.config import EngineConfig, ModelConfig, OptimConfig, structure, unstructure
from verl_core.engine import build_engine
from verl_core.errors import ConfigError
from verl_core.plugins import Registry
from verl_core.testing.losses import policy_loss_fn
from verl_core.testing.tiny import collate, make_samples
from verl_core.toolkit import DistributedCheckpoint
from verl_fsdp import sharding
from verl_fsdp.config import FSDPConfig
from verl_fsdp.engine import FSDPEngine
from verl_fsdp.sharding import check_shard_size

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def registry() -> Registry:
    """What a user gets: built-ins plus installed entry points, nothing passed by hand."""
    return Registry.from_plugins(autoload=True)


def engine_config(model_dir: str, **fields) -> EngineConfig:
    return EngineConfig(backend="fsdp", model=ModelConfig(path=model_dir), device="cpu", **fields)


# -- options (their structuring from a config section is core's PluginContract, test_fsdp_package.py) --


def test_option_errors_name_their_full_path(registry) -> None:
    data = {
        "backend": "fsdp",
        "model": {"path": "m"},
        "fsdp": {"reshard_after_forwad": False, "param_dtype": "fp8", "shard_modules": ["two words"]},
    }
    with pytest.raises(ConfigError) as caught:
        structure(data, EngineConfig, "actor.engine", registry=registry)
    errors = dict(caught.value.errors)
    assert errors["actor.engine.fsdp.reshard_after_forwad"] == (
        "unknown key (did you mean 'reshard_after_forward'?)"
    )
    assert "fp8" in errors["actor.engine.fsdp.param_dtype"]
    assert "bfloat16" in errors["actor.engine.fsdp.param_dtype"]


@pytest.mark.parametrize("shard_size", [0, -2])
def test_shard_size_must_be_a_positive_number_of_ranks(registry, shard_size) -> None:
    data = {"backend": "fsdp", "model": {"path": "m"}, "fsdp": {"shard_size": shard_size}}
    with pytest.raises(ConfigError) as caught:
        structure(data, EngineConfig, "actor.engine", registry=registry)
    assert list(dict(caught.value.errors)) == ["actor.engine.fsdp.shard_size"]


@given(dp_size=st.integers(1, 64), shard_size=st.integers(1, 64))
def test_shard_size_must_divide_the_data_parallel_ranks(dp_size, shard_size) -> None:
    if dp_size % shard_size == 0:
        check_shard_size(shard_size, dp_size)
        return
    with pytest.raises(ConfigError) as caught:
        check_shard_size(shard_size, dp_size, "actor.engine.fsdp")
    [(path, message)] = caught.value.errors
    assert path == "actor.engine.fsdp.shard_size"
    assert str([n for n in range(1, dp_size + 1) if dp_size % n == 0]) in message


def test_shard_modules_must_be_class_names() -> None:
    with pytest.raises(ValueError, match=r"shard_modules: \['two words'\] are not module class names"):
        FSDPConfig(shard_modules=("two words",))


dtype_names = st.sampled_from([None, "float32", "bfloat16", "float16"])
class_names = st.from_regex(r"[A-Z][A-Za-z0-9_]{0,15}", fullmatch=True)


@settings(max_examples=50, deadline=None)
@given(
    options=st.builds(
        FSDPConfig,
        reshard_after_forward=st.booleans(),
        param_dtype=dtype_names,
        reduce_dtype=dtype_names,
        cpu_offload=st.booleans(),
        shard_modules=st.lists(class_names, max_size=3).map(tuple),
        shard_size=st.none() | st.integers(1, 64),
        load_on_rank0=st.booleans(),
        keep_params_gathered=st.booleans(),
    )
)
def test_every_combination_of_options_round_trips_through_plain_data(registry, options) -> None:
    config = EngineConfig(backend="fsdp", model=ModelConfig(path="m"), options=options)
    data = unstructure(config)
    assert data["fsdp"]["shard_modules"] == list(options.shard_modules)  # YAML-friendly: lists, not tuples
    assert structure(data, EngineConfig, registry=registry) == config


# -- the layout's configuration ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_models) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_models.lm)


def test_default_units_are_the_decoder_layers(hf_model) -> None:
    assert sharding.shard_units(hf_model, ()) == list(hf_model.model.layers)[::-1]


def test_units_are_listed_children_before_parents(hf_model) -> None:
    units = sharding.shard_units(hf_model, ("Qwen2DecoderLayer", "Qwen2MLP"))
    assert len(units) == 4
    for layer in hf_model.model.layers:  # fully_shard must see a child before its parent
        assert units.index(layer.mlp) < units.index(layer)


def test_unknown_unit_class_names_the_key_and_the_classes_there_are(hf_model) -> None:
    with pytest.raises(ConfigError) as caught:
        sharding.shard_units(hf_model, ("Qwen2DecoderLayer", "LlamaDecoderLayer"))
    ((path, message),) = caught.value.errors
    assert path == "engine.fsdp.shard_modules"
    assert message.startswith("['LlamaDecoderLayer'] not found in Qwen2ForCausalLM")
    assert "Qwen2DecoderLayer" in message and "Qwen2MLP" in message


def test_cpu_offload_on_an_accelerator_needs_a_cpu_backend(monkeypatch) -> None:
    mesh = SimpleNamespace(device_type="cuda", get_group=lambda: "dp group")
    options = FSDPConfig(cpu_offload=True)
    monkeypatch.setattr(sharding.dist, "get_backend", lambda group: "nccl")
    with pytest.raises(ConfigError) as caught:
        sharding.check_offload_backend(options, mesh)
    ((path, message),) = caught.value.errors
    assert path == "engine.fsdp.cpu_offload"
    assert "backend is 'nccl'" in message and "backend='cpu:gloo,cuda:nccl'" in message
    monkeypatch.setattr(sharding.dist, "get_backend", lambda group: "cpu:gloo,cuda:nccl")
    sharding.check_offload_backend(options, mesh)  # accepted
    sharding.check_offload_backend(FSDPConfig(cpu_offload=False), mesh)  # nothing to check


def test_offload_policy_pins_memory_only_with_a_device() -> None:
    assert sharding.offload_policy(FSDPConfig(cpu_offload=True), "cpu").pin_memory is False
    assert sharding.offload_policy(FSDPConfig(cpu_offload=True), "cuda").pin_memory is True
    assert type(sharding.offload_policy(FSDPConfig(), "cuda")) is torch.distributed.fsdp.OffloadPolicy


# -- the single-process path -----------------------------------------------------------------------------


def test_options_that_need_fsdp_are_refused_without_a_process_group(tiny_models) -> None:
    options = FSDPConfig(param_dtype="bfloat16", cpu_offload=True)
    engine = FSDPEngine(engine_config(tiny_models.lm, options=options))
    with pytest.raises(ConfigError) as caught:
        engine.initialize()
    assert [path for path, _ in caught.value.errors] == ["engine.fsdp.param_dtype", "engine.fsdp.cpu_offload"]
    assert all("call torch.distributed.init_process_group" in message for _, message in caught.value.errors)


def test_hybrid_sharding_is_refused_without_a_process_group(tiny_models) -> None:
    engine = FSDPEngine(engine_config(tiny_models.lm, options=FSDPConfig(shard_size=2)))
    with pytest.raises(ConfigError) as caught:
        engine.initialize()
    assert [path for path, _ in caught.value.errors] == ["engine.fsdp.shard_size"]


def test_single_process_engine_runs_the_plain_model(registry, tiny_models) -> None:
    engine = build_engine(engine_config(tiny_models.lm), registry=registry)
    engine.initialize()
    assert not engine.sharded
    assert all(type(p) is torch.nn.Parameter for p in engine.model.parameters())
    with pytest.raises(RuntimeError, match="already called"):
        engine.initialize()


def test_checkpoint_saved_before_the_first_step_resumes_exactly(registry, tiny_models, tmp_path) -> None:
    """Saving an empty AdamW state must not give it a (zero) step: the next real step would then use
    step 2's bias correction."""
    batch = collate(make_samples(0))
    batch.set_non_tensor("compute_entropy", True)  # the kit's policy loss has an entropy bonus

    def fresh():
        built = build_engine(engine_config(tiny_models.lm, optim=OptimConfig(lr=1e-2)), registry=registry)
        built.initialize()
        return built

    def weights_after_a_step(engine) -> dict[str, torch.Tensor]:
        engine.train_batch(batch, policy_loss_fn)
        return {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()}

    saved, resumed = fresh(), fresh()
    saved.save_checkpoint(str(tmp_path / "step0"), global_step=0)
    assert not (tmp_path / "step0" / DistributedCheckpoint.OPTIMIZER_DIR).exists()
    assert resumed.load_checkpoint(str(tmp_path / "step0")) == 0
    expected = weights_after_a_step(fresh())  # never saved nor loaded
    for engine in (saved, resumed):
        for name, tensor in weights_after_a_step(engine).items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
