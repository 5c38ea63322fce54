"""LoRA through core's HFEngine toolkit (docs/lora.md): the config and its refusals, one step against an
independent peft computation, the kit's ``lora`` check on the DDP engine and on broken variants of it,
and GRPO with an adapter in process (exports that transformers and peft load). The 2-rank FSDP run
under Ray is in test_trainer_ray.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import attrs
import peft
import pytest
import torch
from fixtures.demo import run_overrides
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from verl_core import EngineBackend, hookimpl
from verl_core.config import load_config, structure
from verl_core.config.engine import EngineConfig, ModelConfig
from verl_core.data.batch import COMPUTE_ENTROPY, LOG_PROBS, TEMPERATURE
from verl_core.engine import build_engine
from verl_core.errors import CheckpointError, ConfigError
from verl_core.plugins import Registry
from verl_core.testing.context import BASE_OPTIM, RankContext, exported, infer, train_step
from verl_core.testing.lora_checks import LORA_MODEL, check_lora
from verl_core.testing.losses import TEMPERATURE as KIT_TEMPERATURE
from verl_core.testing.reference import load_reference_model, reference_loss
from verl_core.testing.tiny import collate, make_samples, save_tiny_models
from verl_core.toolkit import LORA_ADAPTER_DIR, LoraAdapter, build_lr_scheduler, build_optimizer
from verl_core.toolkit.lora import hf_name
from verl_core.trainer.rl import RLTrainer
from verl_ddp import plugin as ddp_plugin
from verl_ddp.engine import DDPEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny"))


def lora_engine(path, role="lm", config_path="actor.engine", backend="ddp", optim=BASE_OPTIM, **model):
    config = EngineConfig(
        backend=backend,
        model=ModelConfig(path=str(path), **(LORA_MODEL | model)),
        optim=optim,
        device="cpu",
    )
    return build_engine(config, role, config_path=config_path)


# -- config ------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    rank=st.integers(-3, 64),
    alpha=st.integers(-2, 64),
    dropout=st.floats(-0.5, 1.5, allow_nan=False),
    targets=st.one_of(
        st.sampled_from(["all-linear", "q_proj", ""]),
        st.lists(st.sampled_from(["q_proj", "v_proj", ""]), max_size=3),
        st.integers(0, 3),
    ),
)
def test_lora_keys_are_validated_and_every_error_names_its_key(rank, alpha, dropout, targets) -> None:
    expected = {
        "lora_rank": rank < 0,
        "lora_alpha": alpha <= 0,
        "lora_dropout": not 0 <= dropout < 1,
        "target_modules": not isinstance(targets, (str, list))
        or targets in ("", [])
        or (isinstance(targets, list) and "" in targets),
    }
    raw = {
        "path": "m",
        "lora_rank": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
    }
    try:
        config = structure(raw, ModelConfig)
    except ConfigError as error:
        keys = {path.split("[")[0].split(".")[-1] for path, _ in error.errors}
        assert keys == {key for key, bad in expected.items() if bad}
    else:
        assert not any(expected.values())
        assert config.lora == (rank > 0) and config.target_modules == targets


def test_unknown_target_modules_are_refused_with_the_layers_the_model_has(dirs) -> None:
    engine = lora_engine(dirs.lm, target_modules=["q_proj", "qkv"])
    with pytest.raises(ConfigError) as error:
        engine.initialize()
    ((path, message),) = error.value.errors
    assert path == "actor.engine.model.target_modules"
    assert "['qkv']" in message and "'o_proj'" in message and "'down_proj'" in message


def test_an_adapter_on_an_lm_head_tied_to_the_embeddings_is_refused(dirs, tmp_path) -> None:
    config = AutoConfig.from_pretrained(dirs.lm)
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    engine = lora_engine(tmp_path / "tied", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match="'lm_head' is tied to the input embeddings"):
        engine.initialize()
    untied = lora_engine(dirs.lm, target_modules=["lm_head"])  # its own weight: merged like any layer
    untied.initialize()
    assert [name for name, _ in exported(untied)] == list(
        AutoModelForCausalLM.from_pretrained(dirs.lm).state_dict()
    )


def test_a_critic_and_a_backend_without_lora_are_refused_by_key(dirs) -> None:
    with pytest.raises(ConfigError) as error:  # refused when the engine is built, before any model loads
        lora_engine(dirs.value, role="value", config_path="critic.engine")
    assert error.value.errors[0][0] == "critic.engine.model.lora_rank"
    assert "head starts untrained" in error.value.errors[0][1]
    critic_config = f"{{backend: ddp, model: {{path: {dirs.value}, lora_rank: 8}}}}"
    with pytest.raises(ConfigError) as error:  # and before anything starts, in a run config
        load_config(
            [],
            [
                "actor.engine.backend=ddp",
                f"actor.engine.model.path={dirs.lm}",
                "critic.enable=true",
                f"critic.engine={critic_config}",
                "algorithm.adv_estimator=gae",
            ],
        )
    assert "critic.engine.model.lora_rank" in dict(error.value.errors)
    with pytest.raises(ConfigError) as error:
        lora_engine(dirs.lm, backend="megatron")
    ((path, message),) = error.value.errors
    assert path == "actor.engine.model.lora_rank"
    assert "megatron-core's tensor-parallel" in message and "'ddp'" in message and "'fsdp'" in message


def test_lora_on_a_backend_without_it_is_refused_before_the_run_starts(demo, tmp_path) -> None:
    from verl_core.trainer.preflight import check_run

    changes = {"actor.engine.backend": "megatron", "actor.engine.model.lora_rank": 8}
    problems = dict(check_run(load_config([], run_overrides(demo, tmp_path, **changes)), "rl"))
    assert "does not train LoRA adapters" in problems["actor.engine.model.lora_rank"]


def test_unknown_target_modules_are_refused_before_the_run_starts(demo, tmp_path) -> None:
    from verl_core.trainer.preflight import check_run

    def problems(targets: str) -> dict[str, str]:
        changes = {"actor.engine.model.lora_rank": 8, "actor.engine.model.target_modules": targets}
        return dict(check_run(load_config([], run_overrides(demo, tmp_path, **changes)), "rl"))

    message = problems("[q_prj]")["actor.engine.model.target_modules"]
    assert "['q_prj'] name no linear layer of Qwen2ForCausalLM; it has ['down_proj'" in message
    assert "actor.engine.model.target_modules" not in problems("[q_proj, v_proj]")


# -- one step against peft ---------------------------------------------------------------------------


def test_one_step_trains_only_the_adapter_as_a_peft_model_and_adamw_would(dirs, tmp_path) -> None:
    samples = make_samples(seed=1)
    batch = collate(samples)
    batch.set_non_tensor(TEMPERATURE, KIT_TEMPERATURE)
    batch.set_non_tensor(COMPUTE_ENTROPY, True)
    optim = attrs.evolve(BASE_OPTIM, clip_grad=0.1)  # the first norm is ~0.3: clipping acts
    engine = lora_engine(dirs.lm, optim=optim, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    engine.initialize()
    trainable = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    metrics = train_step(engine, batch)

    # Independently: peft on the plain HF model (seeded as the engine seeds its adapter), torch's
    # AdamW over the adapter, the kit's token-mean loss, clipping to clip_grad; peft's own merge.
    torch.manual_seed(0)
    model = peft.get_peft_model(
        load_reference_model(dirs.lm, "lm"),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    )
    adapter = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        adapter, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    model.train()
    loss = reference_loss(model, samples, "lm", KIT_TEMPERATURE)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(adapter, optim.clip_grad))
    optimizer.step()
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5) and grad_norm > optim.clip_grad
    merged = model.merge_and_unload().state_dict()
    for name, tensor in exported(engine):
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)

    # Optimiser state: two AdamW moments of the adapter, nothing of the base model.
    adapter_numel = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    moments = sum(t.numel() for s in engine.optimizer.state.values() for k, t in s.items() if k != "step")
    assert moments == 2 * adapter_numel
    assert adapter_numel < sum(p.numel() for p in engine.module.parameters()) / 4  # the tiny model: 13%

    # The checkpoint holds the adapter only; a full fine-tuning engine refuses it, saying why.
    engine.save_checkpoint(str(tmp_path / "checkpoint"), global_step=1)
    saved = torch.load(tmp_path / "checkpoint" / "model.pt", weights_only=True)
    assert set(saved) == trainable
    full = build_engine(EngineConfig(backend="ddp", model=ModelConfig(path=str(dirs.lm)), device="cpu"))
    full.initialize()
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint holds a LoRA adapter \(lora.json\), but this engine trains the full model",
    ):
        full.load_checkpoint(str(tmp_path / "checkpoint"))


def test_peft_names_lose_their_prefixes() -> None:
    assert hf_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("base_model.model.lm_head.weight") == "lm_head.weight"


# -- the kit's lora check, and broken engines it fails ------------------------------------------------


class ReferenceWithAdapterEngine(DDPEngine):
    """The reference context forgets to disable the adapter: KL to the current policy, always 0."""

    def reference(self):
        import contextlib

        return contextlib.nullcontext()


class StaleMergeEngine(DDPEngine):
    """verl #7014: the export is a generator consumed after the merged view was dropped: base weights."""

    def get_per_tensor_param(self):
        for name, tensor in self.module.state_dict().items():
            if ".lora_" not in name:
                yield hf_name(name), tensor.detach()


class CachedMergeEngine(DDPEngine):
    """Merges once and sends the same weights at every later sync: the rollout never sees step 2."""

    def get_per_tensor_param(self):
        if not hasattr(self, "_merged"):
            self._merged = [(name, tensor.clone()) for name, tensor in super().get_per_tensor_param()]
        yield from self._merged


class DropoutAtInferenceEngine(DDPEngine):
    """Puts the model in eval mode but leaves the adapters' dropout training: inference is noisy."""

    def set_model_mode(self, train: bool) -> None:
        super().set_model_mode(train)
        for name, module in self.module.named_modules():
            if "lora_dropout" in name:
                module.train()


class IgnoresAlphaEngine(DDPEngine):
    """Builds its adapter at peft's default alpha (8) whatever lora_alpha says."""

    def __init__(self, config, role="lm", *, config_path="engine"):
        super().__init__(config, role, config_path=config_path)
        self.adapter = LoraAdapter(attrs.evolve(config.model, lora_alpha=8), self.adapter.where)


class IgnoresTargetsEngine(DDPEngine):
    """Adapts peft's default target modules for the model type (q_proj, v_proj), not the configured."""

    def __init__(self, config, role="lm", *, config_path="engine"):
        super().__init__(config, role, config_path=config_path)
        self.adapter = LoraAdapter(attrs.evolve(config.model, target_modules=["q_proj", "v_proj"]), "model")


class BaseTrainedEngine(DDPEngine):
    """The base weights stay trainable: the optimiser steps all of them."""

    def initialize(self) -> None:
        super().initialize()
        for parameter in self.module.parameters():
            parameter.requires_grad_(True)
        self.optimizer = build_optimizer(self.model.parameters(), self.config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.config.optim)


EXPORT = "log-probs of the HF model loaded with the weight export"
TARGETS = "exactly the target modules' weights changed, each through the adapter (base weights frozen)"
BROKEN = {
    "ref-with-adapter": (ReferenceWithAdapterEngine, "reference() log-probs after a step"),
    "stale-merge": (StaleMergeEngine, f"{EXPORT}, after a step"),
    "cached-merge": (CachedMergeEngine, f"{EXPORT}, after a second step"),
    "dropout-at-inference": (DropoutAtInferenceEngine, f"{EXPORT}, after a step"),
    "ignores-alpha": (IgnoresAlphaEngine, "the merged change with twice the lora_alpha, after the same step"),
    "ignores-targets": (IgnoresTargetsEngine, TARGETS),
    "base-trained": (BaseTrainedEngine, TARGETS),
}


@hookimpl
def verl_engine_backends():
    module = sys.modules[__name__].__name__
    return [
        EngineBackend(
            name=name,
            engine=f"{module}:{engine.__name__}",
            config="verl_ddp.config:DDPConfig",
            api_version=1,
            lora=True,
        )
        for name, (engine, _) in BROKEN.items()
    ]


def kit_context(backend, dirs, tmp_path) -> RankContext:
    registry = Registry.from_plugins([ddp_plugin, sys.modules[__name__]])
    return RankContext(backend, ("lm",), None, registry, 0, 1, "cpu", dirs, tmp_path)


def test_the_kit_lora_check_passes_the_ddp_engine(dirs, tmp_path) -> None:
    comparisons = check_lora(kit_context("ddp", dirs, tmp_path))
    assert len(comparisons) == 13 and all(c.passed for c in comparisons), [c.describe() for c in comparisons]


@pytest.mark.parametrize("backend", list(BROKEN))
def test_the_kit_lora_check_fails_a_broken_engine_where_it_is_broken(backend, dirs, tmp_path) -> None:
    failed = [c.quantity for c in check_lora(kit_context(backend, dirs, tmp_path)) if not c.passed]
    assert BROKEN[backend][1] in failed, failed


# -- GRPO with an adapter, in process -----------------------------------------------------------------


def vocab_size_of(path) -> int:
    return AutoConfig.from_pretrained(path).vocab_size


def test_grpo_with_lora_in_process_exports_a_merged_model_and_an_adapter_that_load(demo, tmp_path) -> None:
    overrides = run_overrides(
        demo,
        tmp_path,
        **{
            "actor.engine.model.lora_rank": 8,
            "actor.engine.optim.lr": 1e-2,
            "actor.policy_loss.use_kl_loss": "true",
            "trainer.save_hf_model": "true",
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    worker = trainer.actor.group.worker
    assert worker.ref is None and worker.ref_in_policy  # no second model: the base is the reference
    reference_calls = []
    compute_ref = trainer.actor.compute_ref_log_probs
    trainer.actor.compute_ref_log_probs = lambda batch: reference_calls.append(1) or compute_ref(batch)
    final = trainer.fit()
    assert reference_calls and final["actor/grad_norm"] > 0 and math.isfinite(final["actor/kl_loss"])

    samples = make_samples(seed=2, vocab_size=vocab_size_of(demo.model))[:4]
    batch = collate(samples)
    batch.set_non_tensor(TEMPERATURE, 1.0)
    trained = infer(worker.policy, batch)[LOG_PROBS]
    with worker.policy.reference():
        base = infer(worker.policy, batch)[LOG_PROBS]
    export = tmp_path / "run" / "hf_model"

    def log_probs_of(model):
        from verl_core.testing.reference import reference_outputs

        return reference_outputs(model, samples, "lm", 1.0)[LOG_PROBS]

    mask = batch["response_mask"].bool()
    merged = AutoModelForCausalLM.from_pretrained(export)
    torch.testing.assert_close(log_probs_of(merged)[mask], trained[mask], atol=1e-5, rtol=0)
    adapted = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(demo.model), export / LORA_ADAPTER_DIR
    )
    torch.testing.assert_close(log_probs_of(adapted)[mask], trained[mask], atol=1e-5, rtol=0)
    assert (trained - base)[mask].abs().max() > 1e-4  # the adapter trained

    # Starting from the exported adapter: the trained policy, and the base model as its reference.
    resumed = build_engine(
        EngineConfig(
            backend="ddp",
            model=ModelConfig(path=str(demo.model), lora_adapter_path=str(export / LORA_ADAPTER_DIR)),
            device="cpu",
        )
    )
    resumed.initialize()
    torch.testing.assert_close(infer(resumed, batch)[LOG_PROBS][mask], trained[mask], atol=1e-5, rtol=0)
    with resumed.reference():
        torch.testing.assert_close(infer(resumed, batch)[LOG_PROBS][mask], base[mask], atol=1e-5, rtol=0)


def test_a_run_from_a_saved_adapter_generates_with_it_from_the_first_step(demo, tmp_path) -> None:
    adapter = tmp_path / "adapter"
    engine = build_engine(
        EngineConfig(backend="ddp", model=ModelConfig(path=str(demo.model), lora_rank=8), device="cpu")
    )
    engine.initialize()
    with torch.no_grad():  # an adapter that changes the policy (peft starts B at zero)
        for name, parameter in engine.module.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5)
    engine.module.save_pretrained(adapter)
    overrides = run_overrides(
        demo,
        tmp_path,
        **{
            "actor.engine.model.lora_adapter_path": str(adapter),
            "trainer.recompute_old_log_probs": "true",  # the engine's log-probs beside the rollout's
            "trainer.total_training_steps": 1,
        },
    )
    first = RLTrainer.from_config(load_config([], overrides), show_progress=False).fit()
    # The rollout sampled from the policy the engine trains (it once sampled from the base model).
    assert first["rollout/log_prob_diff_max"] < 1e-4


def test_a_missing_adapter_is_reported_before_the_run_starts(demo, tmp_path) -> None:
    from verl_core.trainer.preflight import check_run

    overrides = run_overrides(demo, tmp_path, **{"actor.engine.model.lora_adapter_path": str(tmp_path)})
    problems = dict(check_run(load_config([], overrides), "rl"))
    assert "holds no adapter_config.json" in problems["actor.engine.model.lora_adapter_path"]


def test_the_adapter_has_the_base_models_dtype(dirs) -> None:
    """FSDP2 shards one dtype per unit: peft's float32 adapters on a bfloat16 model would not shard."""
    engine = lora_engine(dirs.lm, dtype="bfloat16")
    engine.initialize()
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}


def test_a_lora_run_resumed_from_its_checkpoint_continues_exactly(demo, tmp_path) -> None:
    """Step 2 after resuming from step 1's adapter checkpoint is bitwise the uninterrupted run's: the
    adapter, its optimiser state, the rollout's merged weights (a stale sync would sample otherwise)."""
    changes = {
        "actor.engine.model.lora_rank": 8,
        "actor.engine.optim.lr": 1e-2,
        "actor.policy_loss.use_kl_loss": "true",
        "trainer.save_freq": 1,
    }

    def run(folder, steps):
        overrides = run_overrides(
            demo, tmp_path / folder, **changes, **{"trainer.total_training_steps": steps}
        )
        trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
        return trainer, trainer.fit()

    straight, expected = run("straight", 2)
    run("resumed", 1)
    resumed, final = run("resumed", 2)
    lines = (tmp_path / "resumed" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # the second run took step 2 only
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl_loss"):
        assert final[key] == expected[key], key
    weights = dict(straight.actor.group.worker.policy.get_per_tensor_param())
    for name, tensor in resumed.actor.group.worker.policy.get_per_tensor_param():
        assert torch.equal(tensor, weights[name]), name


# -- what a resume or a starting adapter cannot be, found before anything starts ----------------------


def perturbed_copy(model: Path, destination: Path, scale: float = 1e-3) -> Path:
    """The model folder ``model`` with every weight moved a little: the same files, names and shapes."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, destination)
    weights = destination / "model.safetensors"
    with safe_open(weights, framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(weights)
    generator = torch.Generator().manual_seed(0)
    moved = {
        name: t + scale * torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in tensors.items()
    }
    save_file(moved, weights, metadata=metadata)
    return destination


def test_the_fingerprint_tells_other_weights_of_the_same_shapes_and_not_a_copy(demo, tmp_path) -> None:
    """The broken variant: a fingerprint of names and sizes alone would not tell the perturbed copy."""
    import shutil

    from verl_core.toolkit.integrity import model_fingerprint

    copy = Path(shutil.copytree(demo.model, tmp_path / "copy"))
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")  # re-saved config
    other = perturbed_copy(Path(demo.model), tmp_path / "other")
    assert (other / "model.safetensors").stat().st_size == (copy / "model.safetensors").stat().st_size
    assert model_fingerprint(str(copy)) == model_fingerprint(str(demo.model))
    assert model_fingerprint(str(other)) != model_fingerprint(str(demo.model))


def test_a_lora_resume_over_another_adapter_or_other_base_weights_is_refused_before_any_worker_starts(
    demo, tmp_path, monkeypatch
) -> None:
    """Over other base weights of the same shapes it continued silently, with other results; over another
    lora_rank it said "another model" from a rank. Now each is a config error naming what differs."""
    from verl_core.trainer.preflight import check_run

    lora = {"actor.engine.model.lora_rank": 8, "trainer.save_freq": 1, "trainer.total_training_steps": 1}
    RLTrainer.from_config(load_config([], run_overrides(demo, tmp_path, **lora)), show_progress=False).fit()

    def no_workers(*args, **kwargs):
        raise AssertionError("the roles' workers were started")

    monkeypatch.setattr("verl_core.trainer.build.build_roles", no_workers)
    other = perturbed_copy(Path(demo.model), tmp_path / "other_base")
    cases = {
        "another base": ({"actor.engine.model.path": other}, "lora_rank", "trained over other base weights"),
        "another rank": (
            {"actor.engine.model.lora_rank": 4},
            "lora_rank",
            "its adapter has lora_rank 8, this run's 4",
        ),
        "full training": ({"actor.engine.model.lora_rank": 0}, "lora_rank", "this run trains the full model"),
    }
    for name, (changes, key, expected) in cases.items():
        changed = {**lora, "trainer.total_training_steps": 2, **changes}
        config = load_config([], run_overrides(demo, tmp_path, **changed))
        with pytest.raises(ConfigError) as caught:
            RLTrainer.from_config(config, show_progress=False)
        errors = dict(caught.value.errors)
        assert expected in errors[f"actor.engine.model.{key}"], (name, errors)
        by_path = {
            "trainer.resume_mode": "resume_path",
            "trainer.resume_from_path": tmp_path / "checkpoints" / "global_step_1",
        }
        problems = dict(check_run(load_config([], run_overrides(demo, tmp_path, **changed, **by_path)), "rl"))
        assert expected in problems[f"actor.engine.model.{key}"], (name, problems)  # verl-core config too
    # The same run resumes (the check is not a refusal of every resume).
    config = load_config([], run_overrides(demo, tmp_path, **{**lora, "trainer.total_training_steps": 2}))
    monkeypatch.undo()
    RLTrainer.from_config(config, show_progress=False).shutdown()


@pytest.fixture(scope="module")
def saved_adapter(dirs, tmp_path_factory) -> Path:
    """A rank-4 adapter over the kit's tiny Qwen2, as PeftModel.save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("adapter") / "lora_adapter"
    model = AutoModelForCausalLM.from_pretrained(dirs.lm)
    peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    ).save_pretrained(folder)
    return folder


def adapter_variant(saved_adapter: Path, tmp_path: Path, damage: str) -> Path:
    import shutil

    folder = Path(shutil.copytree(saved_adapter, tmp_path / damage))
    weights = folder / "adapter_model.safetensors"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no weights":
        weights.unlink()
    elif damage == "broken config":
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4,')
    elif damage == "not lora":
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "PREFIX_TUNING"}))
    return folder


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("cut", "adapter_model.safetensors is"),
        ("no weights", "holds no adapter weights (adapter_model.safetensors or adapter_model.bin)"),
        ("broken config", "adapter_config.json is not valid JSON"),
        ("not lora", "describes a 'PREFIX_TUNING' adapter, not a LoRA one"),
        ("foreign", "was trained for another model"),
    ],
)
def test_a_broken_cut_or_foreign_adapter_is_refused_before_the_run_starts(
    demo, dirs, saved_adapter, tmp_path, damage, expected
) -> None:
    """It was found only on the ranks (a missing weights file blamed on a hub "Repo id"). The adapter
    was saved over the kit's tiny model: for the demo's model (other sizes) it is foreign."""
    from verl_core.trainer.preflight import check_run

    adapter = adapter_variant(saved_adapter, tmp_path, damage)
    overrides = run_overrides(demo, tmp_path, **{"actor.engine.model.lora_adapter_path": adapter})
    problems = dict(check_run(load_config([], overrides), "rl"))
    assert expected in problems["actor.engine.model.lora_adapter_path"], problems
    if damage != "foreign":  # the same adapter over its own model passes: only the damage is refused
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            lora_engine(dirs.lm, lora_adapter_path=str(adapter)).initialize()
    else:
        fine = run_overrides(demo, tmp_path, **{"actor.engine.model.lora_adapter_path": saved_adapter})
        fine[fine.index(f"actor.engine.model.path={demo.model}")] = f"actor.engine.model.path={dirs.lm}"
        assert "actor.engine.model.lora_adapter_path" not in dict(check_run(load_config([], fine), "rl"))
