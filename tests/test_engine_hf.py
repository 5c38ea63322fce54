"""Hugging Face models for engines: loading per role, the micro-batch forward, the export.

The reference runs every sample alone and unpadded with default positions, so a wrong column
offset, dropped ``position_ids`` or a padding leak shows up as a mismatch.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from verl_core.config.engine import ModelConfig
from verl_core.data import COMPUTE_ENTROPY, ENTROPY, LOG_PROBS, TEMPERATURE
from verl_core.errors import CheckpointError, ConfigError
from verl_core.testing.tiny import collate, make_samples, save_tiny_models
from verl_core.toolkit import export_hf_model, forward_micro_batch, load_hf_model
from verl_core.toolkit.model import compile_decoder_layers

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def samples():
    return make_samples(seed=3)[:6]


def unpadded_logits(model, sample) -> torch.Tensor:
    """Logits predicting each response token, from the sample alone: [r, V] (or [r, 1] for values)."""
    with torch.no_grad():
        logits = model(input_ids=sample.input_ids.unsqueeze(0)).logits[0]
    prompt_length = len(sample.prompt)
    return logits[prompt_length - 1 : prompt_length + len(sample.response) - 1]


@pytest.mark.parametrize("logits_chunk_size", [None, 5], ids=["whole", "chunks of 5"])
def test_lm_log_probs_and_entropy_match_unpadded_reference(dirs, samples, logits_chunk_size) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm), role="lm").eval()
    batch = collate(samples)
    batch.set_non_tensor(TEMPERATURE, 0.7)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    with torch.no_grad():
        output = forward_micro_batch(model, batch, role="lm", logits_chunk_size=logits_chunk_size)
    assert set(output) == {LOG_PROBS, ENTROPY}
    assert output[LOG_PROBS].shape == output[ENTROPY].shape == batch["responses"].shape
    for row, sample in enumerate(samples):
        log_p = torch.log_softmax(unpadded_logits(model, sample).double() / 0.7, dim=-1)
        expected_log_probs = log_p.gather(-1, sample.response.unsqueeze(-1)).squeeze(-1)
        expected_entropy = -(log_p.exp() * log_p).sum(-1)
        length = len(sample.response)
        torch.testing.assert_close(
            output[LOG_PROBS][row, :length].double(), expected_log_probs, atol=2e-5, rtol=0
        )
        torch.testing.assert_close(
            output[ENTROPY][row, :length].double(), expected_entropy, atol=2e-5, rtol=0
        )


def test_lm_defaults_to_temperature_one_without_entropy(dirs, samples) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm), role="lm").eval()
    with torch.no_grad():
        output = forward_micro_batch(model, collate(samples[:2]), role="lm")
    assert set(output) == {LOG_PROBS}
    log_p = torch.log_softmax(unpadded_logits(model, samples[0]), dim=-1)
    expected = log_p.gather(-1, samples[0].response.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(output[LOG_PROBS][0, : len(samples[0].response)], expected, atol=2e-5, rtol=0)
    # RoPE hides a uniform position shift, so check directly that position_ids reach the model.
    batch = collate(samples[:2])
    batch["position_ids"] = torch.zeros_like(batch["position_ids"])
    with torch.no_grad():
        assert not torch.allclose(forward_micro_batch(model, batch, role="lm")[LOG_PROBS], output[LOG_PROBS])


def test_value_head_from_a_causal_lm_is_seeded_and_dropout_free(dirs, samples) -> None:
    torch.manual_seed(123)  # the caller's random state must not matter ...
    first = load_hf_model(ModelConfig(path=dirs.lm), role="value", seed=5)
    state_after_load = torch.random.get_rng_state()
    torch.manual_seed(999)
    second = load_hf_model(ModelConfig(path=dirs.lm), role="value", seed=5)
    other_seed = load_hf_model(ModelConfig(path=dirs.lm), role="value", seed=6)
    torch.manual_seed(123)
    assert torch.equal(torch.random.get_rng_state(), state_after_load)  # ... nor be disturbed by loading
    assert type(first).__name__ == "Qwen2ForTokenClassification"
    assert torch.equal(first.score.weight, second.score.weight)
    assert not torch.equal(first.score.weight, other_seed.score.weight)
    assert first.config.num_labels == 1
    # In train mode, two passes agree: the head's dropout is off.
    batch = collate(samples)
    values = forward_micro_batch(first, batch, role="value")["values"]
    assert first.training and torch.equal(values, forward_micro_batch(first, batch, role="value")["values"])
    assert values.shape == batch["responses"].shape and values.dtype == torch.float32
    for row, sample in enumerate(samples):
        expected = unpadded_logits(first, sample)[:, 0]
        torch.testing.assert_close(values[row, : len(sample.response)].detach(), expected, atol=2e-5, rtol=0)


def test_value_model_keeps_a_saved_head(dirs) -> None:
    saved = AutoModelForTokenClassification.from_pretrained(dirs.value)
    loaded = load_hf_model(ModelConfig(path=dirs.value), role="value", seed=1)
    assert torch.equal(saved.score.weight, loaded.score.weight)


@pytest.mark.parametrize("logits_chunk_size", [None, 5], ids=["whole", "chunks of 5"])
def test_model_options_dtype_and_activation_checkpointing(dirs, samples, logits_chunk_size) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm, dtype="bfloat16", gradient_checkpointing=True), role="lm")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.training and model.is_activation_checkpointing
    output = forward_micro_batch(model, collate(samples[:2]), role="lm", logits_chunk_size=logits_chunk_size)
    assert output[LOG_PROBS].dtype == torch.float32  # upcast before the softmax
    output[LOG_PROBS].sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_unknown_role_is_refused(dirs) -> None:
    with pytest.raises(ValueError, match=r"'critic' is not a ModelRole: expected one of \['lm', 'value'\]"):
        load_hf_model(ModelConfig(path=dirs.lm), role="critic")


def test_export_round_trips_through_from_pretrained(dirs, tmp_path) -> None:
    source = tmp_path / "source"
    AutoModelForCausalLM.from_pretrained(dirs.lm).save_pretrained(source)
    (source / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    model = load_hf_model(ModelConfig(path=str(source)), role="lm")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # an export must write the current weights, not the source's
    export_hf_model(model, tmp_path / "export", tokenizer_source=source)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert list(reloaded.state_dict()) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert any(path.suffix == ".safetensors" for path in (tmp_path / "export").iterdir())
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text()) == {"model_max_length": 64}


def test_export_interrupted_mid_write_leaves_the_previous_export(dirs, tmp_path, monkeypatch) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm), role="lm")
    export_hf_model(model, tmp_path / "export")
    previous = {path.name: path.read_bytes() for path in (tmp_path / "export").iterdir()}

    def crash_after_the_config(self, directory, **kwargs):
        self.config.save_pretrained(directory)  # a partial directory: config.json but no weights
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", crash_after_the_config)
    with pytest.raises(OSError, match="disk full"):
        export_hf_model(model, tmp_path / "export")
    assert {path.name: path.read_bytes() for path in (tmp_path / "export").iterdir()} == previous
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export"]  # no staging left behind
    with pytest.raises(OSError, match="disk full"):
        export_hf_model(model, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()  # never half-written


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_gets_the_mode_the_umask_gives(dirs, tmp_path, umask) -> None:
    """safetensors writes its files 0600, the rest of the export got 0644: unreadable to the group."""
    source = tmp_path / "source"
    AutoModelForCausalLM.from_pretrained(dirs.lm).save_pretrained(source)
    (source / "tokenizer_config.json").write_text("{}")
    (source / "tokenizer_config.json").chmod(0o600)  # copied with its mode, which must not stay either
    model = load_hf_model(ModelConfig(path=str(source)), role="lm")
    previous = os.umask(umask)
    try:
        export_hf_model(model, tmp_path / "export", tokenizer_source=source)
    finally:
        os.umask(previous)
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in (tmp_path / "export").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= set(modes)
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))


def test_export_refuses_to_replace_a_directory_that_is_not_a_model(dirs, tmp_path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    model = load_hf_model(ModelConfig(path=dirs.lm), role="lm")
    with pytest.raises(
        CheckpointError, match=r"notes exists and holds no config.json.*write to another path"
    ):
        export_hf_model(model, tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


# -- model paths: local folders only, and every wrong path says what it is -------------------------


def test_model_paths_that_are_not_model_folders_name_the_key_and_the_fix(tmp_path, monkeypatch) -> None:
    (tmp_path / "weights.safetensors").write_text("")
    (tmp_path / "empty").mkdir()
    # A hub id must never reach the network: make any attempt fail loudly instead of hanging.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = {
        str(tmp_path / "missing"): "does not exist (relative paths are relative to",
        "Qwen/Qwen2-0.5B": "if it is a Hugging Face hub id: models load from local folders only",
        str(tmp_path / "weights.safetensors"): "is a file; give the model's folder",
        str(tmp_path / "empty"): "is a folder without config.json, so it is not a Hugging Face model",
    }
    for path, problem in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_hf_model(ModelConfig(path=path), where="actor.engine.model")
        ((key, message),) = caught.value.errors
        assert key == "actor.engine.model.path" and problem in message, message
    with pytest.raises(ConfigError, match="hf download Qwen/Qwen2-0.5B --local-dir models/Qwen2-0.5B"):
        load_hf_model(ModelConfig(path="Qwen/Qwen2-0.5B"))


def test_a_hub_id_that_is_also_a_local_folder_loads_from_the_folder(dirs, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny").symlink_to(dirs.lm)
    model = load_hf_model(ModelConfig(path="org/tiny"))
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(dirs.lm).config.vocab_size


def test_compiled_decoder_layers_compute_what_eager_layers_do(dirs, samples, monkeypatch) -> None:
    """``compile_layers`` runs each decoder layer through ``torch.compile`` (dynamo captures graphs)
    and changes neither the outputs (1e-5) nor the gradients (1e-6) of a packed micro-batch.

    The graphs run on the ``aot_eager`` backend (dynamo and AOT autograd, as with inductor, without
    the minute of C++ code generation on this CPU); benchmarks/engine_overhead.py runs inductor."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    counters.clear()
    results = []
    for compile_layers in (False, True):
        model = load_hf_model(ModelConfig(path=dirs.lm, compile_layers=compile_layers), packing=True)
        batch = collate(samples)
        batch.set_non_tensor(COMPUTE_ENTROPY, True)
        output = forward_micro_batch(model, batch, role="lm", packing=True)
        (output[LOG_PROBS].sum() + output[ENTROPY].sum()).backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        results.append((output[LOG_PROBS].detach(), output[ENTROPY].detach(), grads))
    assert counters["stats"]["unique_graphs"] >= 1, "no layer ran compiled"
    (log_probs, entropy, grads), (compiled_log_probs, compiled_entropy, compiled_grads) = results
    torch.testing.assert_close(compiled_log_probs, log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled_entropy, entropy, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-6, rtol=0, msg=name)


def test_compile_layers_needs_decoder_layer_classes(dirs) -> None:
    model = load_hf_model(ModelConfig(path=dirs.lm))
    model._no_split_modules = []
    with pytest.raises(ConfigError) as caught:
        compile_decoder_layers(model, "actor.engine.model.compile_layers")
    assert [path for path, _ in caught.value.errors] == ["actor.engine.model.compile_layers"]
