"""Round trips over generated run configs: structure(unstructure(x)) == x, YAML dump and reload;
and an unknown key, a non-finite float or an unknown component name anywhere is reported at its
full path and nowhere else."""

from __future__ import annotations

import math
import string
import tempfile
import typing
from pathlib import Path
from typing import Literal

import attrs
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_core import AdvantageEstimator, EngineBackend, RewardFunction, RolloutBackend, hookimpl
from verl_core.config import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    CriticLossConfig,
    DataConfig,
    EngineConfig,
    KLControlConfig,
    MicroBatchConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    dump_yaml,
    load_config,
    structure,
    unstructure,
)
from verl_core.config.algorithm import KL_PENALTIES, LossAggMode, RolloutCorrectionConfig
from verl_core.errors import ConfigError
from verl_core.plugins import Kind, Registry

# Generated configs set options the run ignores (ref.engine with no KL term, ...): the warnings are
# tested in test_config.py.
pytestmark = pytest.mark.filterwarnings("ignore::verl_core.errors.ConfigWarning")


@attrs.define
class SpinOptions:
    """Exercises what backend options may hold: tuples, optionals, literals, nested classes, lists."""

    @attrs.define
    class Mesh:
        shape: tuple[int, ...] = (1,)
        names: list[str] = attrs.field(factory=list)

    rate: float = 1.0
    limit: int | None = None
    kind: Literal["a", "b"] = "a"
    mesh: Mesh = attrs.field(factory=Mesh)


@attrs.define
class PlainOptions:
    flag: bool = False


class Backends:
    @staticmethod
    @hookimpl
    def verl_engine_backends() -> list[EngineBackend]:
        return [
            EngineBackend(name="spin", engine="fixtures.engines:Engine", config=SpinOptions, api_version=1),
            EngineBackend(name="plain", engine="fixtures.engines:Engine", config=PlainOptions, api_version=1),
        ]

    @staticmethod
    @hookimpl
    def verl_rollout_backends() -> list[RolloutBackend]:
        return [
            RolloutBackend(name="spinroll", rollout="fixtures.engines:Engine", config=SpinOptions),
            RolloutBackend(name="plainroll", rollout="fixtures.engines:Engine", config=PlainOptions),
        ]

    @staticmethod
    @hookimpl
    def verl_advantage_estimators() -> list[AdvantageEstimator]:
        return [AdvantageEstimator(name="my_plugin_estimator", function="fixtures.engines:Engine")]

    @staticmethod
    @hookimpl
    def verl_reward_functions() -> list[RewardFunction]:
        return [
            RewardFunction(name="plain_reward", function="fixtures.engines:Engine"),
            RewardFunction(name="other_reward", function="fixtures.engines:Engine"),
        ]


REGISTRY = Registry.from_plugins([Backends])

names = st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)
texts = st.text(max_size=12)  # any unicode: YAML must carry it back unchanged
non_empty_texts = st.text(min_size=1, max_size=12)


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def literal(tp: object) -> st.SearchStrategy[str]:
    return st.sampled_from(typing.get_args(tp))


def field_type(cls: type, name: str) -> object:
    return typing.get_type_hints(cls)[name]


options = st.one_of(
    st.builds(
        SpinOptions,
        rate=floats(-1e6, 1e6),
        limit=st.none() | st.integers(),
        kind=st.sampled_from(["a", "b"]),
        mesh=st.builds(
            SpinOptions.Mesh,
            shape=st.lists(st.integers(1, 8), max_size=3).map(tuple),
            names=st.lists(texts, max_size=3),
        ),
    ),
    st.builds(PlainOptions, flag=st.booleans()),
)


@st.composite
def optims(draw: st.DrawFn) -> OptimConfig:
    """A decaying schedule's ``total_steps`` is 0 (the run's length) or longer than its warmup."""
    lr_scheduler = draw(literal(field_type(OptimConfig, "lr_scheduler")))
    lr_warmup_steps = draw(st.integers(0, 1000))
    longer = st.integers(lr_warmup_steps + 1, 10**6)
    total_steps = draw(st.integers(0, 10**6) if lr_scheduler == "constant" else st.just(0) | longer)
    return OptimConfig(
        lr=draw(floats(0, 1)),
        betas=draw(st.tuples(floats(0, 0.999), floats(0, 0.999))),
        eps=draw(floats(1e-12, 1e-3)),
        weight_decay=draw(floats(0, 1)),
        clip_grad=draw(floats(0, 10)),
        lr_warmup_steps=lr_warmup_steps,
        lr_scheduler=lr_scheduler,
        min_lr_ratio=draw(floats(0, 1)),
        total_steps=total_steps,
    )


engines = options.flatmap(
    lambda backend_options: st.builds(
        EngineConfig,
        backend=st.just("spin" if isinstance(backend_options, SpinOptions) else "plain"),
        options=st.just(backend_options),
        model=st.builds(
            ModelConfig,
            path=non_empty_texts,
            dtype=literal(field_type(ModelConfig, "dtype")),
            attn_implementation=texts,
            trust_remote_code=st.booleans(),
            gradient_checkpointing=st.booleans(),
        ),
        optim=optims(),
        micro_batch=st.builds(
            MicroBatchConfig,
            micro_batch_size=st.integers(1, 64),
            use_dynamic_bsz=st.booleans(),
            max_token_len=st.integers(1, 10**5),
        ),
        device=st.sampled_from(["auto", "cpu", "cuda:1"]),
        param_offload=st.booleans(),
        optimizer_offload=st.booleans(),
        seed=st.integers(-(2**63), 2**63),
    )
)

extras = st.dictionaries(
    names, st.none() | st.booleans() | st.integers() | floats(-1e9, 1e9) | texts, max_size=3
)
policy_losses = st.builds(
    PolicyLossConfig,
    loss_mode=st.sampled_from(REGISTRY.names(Kind.POLICY_LOSSES)),
    loss_agg_mode=literal(LossAggMode),
    clip_ratio=floats(0, 1),
    clip_ratio_low=st.none() | floats(0, 1),
    clip_ratio_high=st.none() | floats(0, 1),
    clip_ratio_c=floats(1.001, 10),
    entropy_coeff=floats(0, 1),
    use_kl_loss=st.booleans(),
    kl_loss_coef=floats(0, 1),
    kl_loss_type=st.sampled_from(KL_PENALTIES),
    rollout_is_cap=st.none() | floats(0.1, 10),
    extra=extras,
    rollout_correction=st.one_of(
        st.builds(
            RolloutCorrectionConfig,
            rollout_is=st.none() | st.sampled_from(["token", "sequence"]),
            rollout_is_threshold=floats(0.1, 10) | st.sampled_from(["0.5_5.0", "0_3.0", "2"]),
        ),
        st.sampled_from(
            [("seq_mean_k1", "0.999_1.001"), ("token_k3", 0.01), ("seq_sum_k1, seq_max_k2", 2.0)]
        ).map(lambda rs: RolloutCorrectionConfig(rollout_rs=rs[0], rollout_rs_threshold=rs[1])),
        st.just(RolloutCorrectionConfig(bypass_mode=True)),
    ),
).filter(  # the deprecated cap is rollout_is: token, so neither with rollout_is nor with bypass_mode
    lambda loss: (
        loss.rollout_is_cap is None
        or (loss.rollout_correction.rollout_is is None and not loss.rollout_correction.bypass_mode)
    )
)
algorithms = st.builds(
    AlgorithmConfig,
    adv_estimator=st.sampled_from(["gae", "grpo", "rloo", "my_plugin_estimator"]),
    gamma=floats(0, 1),
    lam=floats(0, 1),
    norm_adv_by_std_in_grpo=st.booleans(),
    use_kl_in_reward=st.booleans(),
    kl_penalty=st.sampled_from(KL_PENALTIES),
    kl_ctrl=st.builds(
        KLControlConfig,
        type=literal(field_type(KLControlConfig, "type")),
        kl_coef=floats(0, 1),
        target_kl=floats(1e-3, 1),
        horizon=st.integers(1, 10**5),
    ),
    extra=extras,
)
rollouts = options.flatmap(
    lambda backend_options: st.builds(
        RolloutConfig,
        backend=st.just("spinroll" if isinstance(backend_options, SpinOptions) else "plainroll"),
        options=st.just(backend_options),
        n=st.integers(2, 16),
        temperature=floats(1e-3, 2),
        top_p=floats(1e-3, 1),
        top_k=st.integers(0, 100),
        prompt_length=st.integers(1, 4096),
        response_length=st.integers(1, 4096),
        dtype=st.none() | literal(field_type(ModelConfig, "dtype")),
    )
)
rewards = st.builds(
    RewardConfig,
    function=st.sampled_from(REGISTRY.names(Kind.REWARD_FUNCTIONS)),
    on_error=literal(field_type(RewardConfig, "on_error")),
)
#: The metric sinks installed here (``tensorboard`` and the trackers are extras): a config naming
#: another is refused when it loads.
AVAILABLE_SINKS = [
    entry.name for entry in Registry.from_plugins().entries(Kind.METRIC_SINKS) if entry.status == "ok"
]

trainers = st.builds(
    TrainerConfig,
    total_epochs=st.integers(1, 10),
    total_training_steps=st.none() | st.integers(1, 10**6),
    save_freq=st.integers(0, 100),
    test_freq=st.integers(0, 100),
    checkpoint_dir=non_empty_texts,
    resume_mode=st.sampled_from(["auto", "disable"]),
    resume_from_path=st.none() | texts,
    seed=st.integers(0, 2**32),
    logger=st.lists(st.sampled_from(AVAILABLE_SINKS), max_size=2),
)


@st.composite
def run_configs(draw: st.DrawFn) -> RunConfig:
    """Valid configs: the cross-section rules (mini-batches divide the batch, gae has a critic) hold."""
    mini_batch = draw(st.integers(1, 16))
    algorithm = draw(algorithms)
    trainer = draw(trainers)
    critic_engine = draw(st.none() | engines) if algorithm.adv_estimator != "gae" else draw(engines)
    ref_engine = draw(st.none() | engines)
    return RunConfig(
        actor=ActorConfig(
            engine=draw(engines),
            policy_loss=draw(policy_losses),
            ppo_mini_batch_size=mini_batch,
            ppo_epochs=draw(st.integers(1, 4)),
        ),
        ref=RefConfig(engine=ref_engine),
        critic=CriticConfig(
            enable=algorithm.adv_estimator == "gae" or (critic_engine is not None and draw(st.booleans())),
            engine=critic_engine,
            loss=CriticLossConfig(
                cliprange_value=draw(floats(1e-3, 10)), loss_agg_mode=draw(literal(LossAggMode))
            ),
        ),
        rollout=draw(rollouts),
        reward=draw(rewards),
        algorithm=algorithm,
        data=DataConfig(
            train_files=draw(st.lists(texts, max_size=3)),
            val_files=draw(st.lists(texts, max_size=3)),
            train_batch_size=mini_batch * draw(st.integers(1, 8)),
            prompt_key=draw(non_empty_texts),
            shuffle=draw(st.booleans()),
            seed=draw(st.integers(0, 2**32)),
        ),
        trainer=trainer,
    )


@settings(max_examples=60, deadline=None)
@given(config=run_configs())
def test_structure_inverts_unstructure(config):
    assert structure(unstructure(config), RunConfig, registry=REGISTRY) == config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=run_configs())
def test_load_config_reads_dump_yaml_back(config):
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "run.yaml"
        path.write_text(dump_yaml(config), encoding="utf-8")
        assert load_config([path], registry=REGISTRY) == config
    assert yaml.safe_load(dump_yaml(config)) == unstructure(config)  # a YAML 1.1 reader agrees


#: Mappings of a config that are values, not sections: free-form options, Ray resources by name, the
#: distillation teachers by name (a new key is a new teacher), an environment's options
#: (``rollout.agent.options``: checked against its descriptor's class by preflight).
FREE_FORM = ("extra", "replica_resources", "rank_resources", "teachers", "options")


def sections(data: dict, path: str = "") -> list[str]:
    """Dotted paths of every mapping in unstructured config data that is a config section."""
    found = [path]
    for key, value in data.items():
        if isinstance(value, dict) and key not in FREE_FORM:  # any key goes in these
            found += sections(value, f"{path}.{key}" if path else key)
    return found


@settings(max_examples=40, deadline=None)
@given(config=run_configs(), data=st.data())
def test_an_unknown_key_is_reported_at_its_full_path_only(config, data):
    raw = unstructure(config)
    section = data.draw(st.sampled_from(sections(raw)), label="section")
    target = raw
    for key in filter(None, section.split(".")):
        target = target[key]
    target["zz_unknown"] = 1
    with pytest.raises(ConfigError) as caught:
        structure(raw, RunConfig, registry=REGISTRY)
    ((path, message),) = caught.value.errors
    assert path == (f"{section}.zz_unknown" if section else "zz_unknown")
    assert message.startswith("unknown key (allowed keys: ")


def leaves(data: object, path: str = "") -> list[tuple[str, object, object]]:
    """``(dotted.path, container, key)`` of every scalar in unstructured config data, ``extra`` (free
    form) left out."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        if key == "extra":
            continue
        here = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found += leaves(value, here) if isinstance(value, (dict, list)) else [(here, data, key)]
    return found


@settings(max_examples=60, deadline=None)
@given(config=run_configs(), data=st.data())
def test_a_non_finite_float_is_reported_at_its_path_only(config, data):
    raw = unstructure(config)
    floats_in = [leaf for leaf in leaves(raw) if type(leaf[1][leaf[2]]) is float]
    path, container, key = data.draw(st.sampled_from(floats_in), label="float")
    container[key] = data.draw(st.sampled_from([math.inf, -math.inf, math.nan]), label="value")
    with pytest.raises(ConfigError) as caught:
        structure(raw, RunConfig, registry=REGISTRY)
    assert caught.value.errors == [(path, f"expected a finite float, got {container[key]!r}")]


def named_paths(raw: dict) -> list[str]:
    """The keys of unstructured config data that name a registered component or a fixed choice."""
    paths = [
        "algorithm.adv_estimator",
        "algorithm.kl_penalty",
        "actor.policy_loss.loss_mode",
        "actor.policy_loss.kl_loss_type",
        "rollout.backend",
        "reward.function",
    ]
    for section in ("actor", "ref", "critic"):
        if raw[section]["engine"] is not None:
            paths += [f"{section}.engine.backend", f"{section}.engine.device"]
    return paths


@settings(max_examples=60, deadline=None)
@given(config=run_configs(), data=st.data())
def test_an_unknown_name_is_reported_at_its_path_only(config, data):
    raw = unstructure(config)
    path = data.draw(st.sampled_from(named_paths(raw)), label="path")
    *sections, key = path.split(".")
    container = raw
    for section in sections:
        container = container[section]
    misspelt = container[key] + data.draw(st.sampled_from(["x", "_"]), label="suffix")
    container[key] = misspelt
    with pytest.raises(ConfigError) as caught:
        structure(raw, RunConfig, registry=REGISTRY)
    ((where, message),) = caught.value.errors
    assert where == path
    assert repr(misspelt) in message and "\n" not in message
    assert "did you mean" in message.lower()  # one suffix away from a valid name
