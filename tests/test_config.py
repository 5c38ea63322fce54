"""Loading run configs: YAML files, dotted overrides, backend options, and the errors they report.

Every error test asserts the full dotted path and the words that tell the user the fix. The round
trip properties over generated configs are in test_config_roundtrip.py; the lookup of each
component name (estimators, losses, KL estimators, devices, rollouts, rewards) in
test_config_names.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import typing
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import attrs
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from verl_core import EngineBackend, hookimpl
from verl_core.config import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    AsyncTrainingConfig,
    CriticConfig,
    CriticLossConfig,
    DataConfig,
    DistillationConfig,
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
    TeacherConfig,
    TrainerConfig,
    dump_yaml,
    load_config,
    structure,
    unstructure,
)
from verl_core.config.algorithm import FilterGroupsConfig, LossAggMode, RolloutCorrectionConfig
from verl_core.config.engine import DtypeName
from verl_core.config.loading import fill_total_steps, parse_override
from verl_core.config.validators import InvalidValue
from verl_core.errors import ConfigError, ConfigWarning
from verl_core.plugins import Registry, get_registry
from verl_core.rollout.config import HFRolloutConfig

REPO = Path(__file__).resolve().parents[1]


@attrs.define
class ToyOptions:
    bucket_cap_mb: int = attrs.field(default=25, validator=attrs.validators.gt(0))
    mode: Literal["sync", "async"] = "sync"


@attrs.define
class OtherOptions:
    shards: int = 1


class ToyPlugin:
    @staticmethod
    @hookimpl
    def verl_engine_backends() -> list[EngineBackend]:
        return [
            EngineBackend(name="toy", engine="fixtures.engines:Engine", config=ToyOptions, api_version=1),
            EngineBackend(name="other", engine="fixtures.engines:Engine", config=OtherOptions, api_version=1),
        ]


REGISTRY = Registry.from_plugins([ToyPlugin])

VALID = """\
actor:
  engine:
    backend: toy
    toy: {bucket_cap_mb: 10}
    model: {path: /models/tiny}
    optim: {lr: 1e-5}
  ppo_mini_batch_size: 4
algorithm: {adv_estimator: grpo}
rollout: {n: 2}
data: {train_batch_size: 8, train_files: [a.jsonl, b.jsonl]}
"""

#: ``VALID`` as overrides, for tests that load many configs (hypothesis) without files.
OVERRIDES = [
    "actor.engine.backend=toy",
    "actor.engine.model.path=/models/tiny",
    "actor.ppo_mini_batch_size=4",
    "algorithm.adv_estimator=grpo",
    "rollout.n=2",
    "data.train_batch_size=8",
]


def write(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def load(tmp_path: Path, text: str = VALID, overrides: typing.Iterable[str] = ()) -> RunConfig:
    return load_config([write(tmp_path, "run.yaml", text)], overrides, registry=REGISTRY)


def errors_of(tmp_path: Path, text: str = VALID, overrides: typing.Iterable[str] = ()) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, overrides)
    paths = [path for path, _ in caught.value.errors]
    assert len(paths) == len(set(paths)), f"one error per path: {caught.value}"
    return dict(caught.value.errors)


# -- loading --------------------------------------------------------------------------------------


def test_yaml_file_gives_the_sections_with_backend_options_and_defaults(tmp_path):
    config = load(tmp_path)
    engine = config.actor.engine
    assert engine == EngineConfig(
        backend="toy",
        model=ModelConfig(path="/models/tiny"),
        options=ToyOptions(bucket_cap_mb=10),
        optim=OptimConfig(lr=1e-5),
    )
    assert type(engine.optim.lr) is float  # YAML 1.2: 1e-5 is a float, not the string "1e-5"
    assert config.data.train_files == ["a.jsonl", "b.jsonl"]
    assert config.critic == CriticConfig() and config.actor.policy_loss == PolicyLossConfig()
    assert config.ref_engine is engine  # no ref.engine: the reference uses the actor's


def test_absent_options_section_gives_the_backend_defaults(tmp_path):
    config = load(tmp_path, VALID.replace("    toy: {bucket_cap_mb: 10}\n", ""))
    assert config.actor.engine.options == ToyOptions()


def test_overrides_set_scalars_null_lists_items_and_new_sections(tmp_path):
    base = VALID + "trainer: {total_training_steps: 5, resume_from_path: /ckpt}\n"
    with pytest.warns(ConfigWarning, match=r"^ref\.engine: ignored: no KL term is on"):
        config = load(
            tmp_path,
            base,
            [
                "actor.engine.optim.lr=3e-4",
                "rollout.temperature=0.7",
                "data.shuffle=false",
                "trainer.total_training_steps=null",
                "trainer.resume_from_path=",
                "trainer.logger=[]",
                "data.train_files[0]=c.jsonl",
                "data.train_files[2]=d.jsonl",
                "data.val_files[0]=v.jsonl",
                "ref.engine={backend: other, model: {path: /models/ref}}",
                "actor.engine.toy.mode=async",
                "actor.engine.model.path=/models/x=y",  # only the first '=' separates key and value
            ],
        )
    assert config.actor.engine.optim.lr == 3e-4
    assert config.rollout.temperature == 0.7
    assert config.data.shuffle is False
    assert config.trainer.total_training_steps is None and config.trainer.resume_from_path is None
    assert config.trainer.logger == []
    assert config.data.train_files == ["c.jsonl", "b.jsonl", "d.jsonl"]
    assert config.data.val_files == ["v.jsonl"]
    assert config.ref.engine == EngineConfig(
        backend="other", model=ModelConfig(path="/models/ref"), options=OtherOptions()
    )
    assert config.actor.engine.options == ToyOptions(bucket_cap_mb=10, mode="async")
    assert config.actor.engine.model.path == "/models/x=y"


def test_later_files_merge_mappings_and_replace_lists(tmp_path):
    first = write(tmp_path, "base.yaml", VALID)
    second = write(
        tmp_path,
        "more.yaml",
        """\
        actor: {engine: {optim: {weight_decay: 0.5}}}
        data: {train_files: [z.jsonl]}
        """,
    )
    config = load_config([first, second], registry=REGISTRY)
    assert config.actor.engine.optim == OptimConfig(lr=1e-5, weight_decay=0.5)
    assert config.actor.engine.options == ToyOptions(bucket_cap_mb=10)
    assert config.data.train_files == ["z.jsonl"]


def test_yaml_aliases_are_copies_that_overrides_change_one_at_a_time(tmp_path):
    text = VALID.replace("  engine:\n", "  engine: &engine\n") + "ref: {engine: *engine}\n"
    with pytest.warns(ConfigWarning, match=r"^ref\.engine: ignored: no KL term is on"):
        config = load(tmp_path, text, ["ref.engine.optim.lr=0.5"])
    assert config.ref.engine == attrs.evolve(config.actor.engine, optim=OptimConfig(lr=0.5))
    assert config.actor.engine.optim.lr == 1e-5


def test_one_override_switches_backend_and_sections_of_other_installed_backends_are_kept_quiet(tmp_path):
    text = VALID.replace(
        "    toy: {bucket_cap_mb: 10}\n", "    toy: {bucket_cap_mb: 10}\n    other: {shards: 4}\n"
    )
    # Accepted, and not silently: the run ignores the other backend's section.
    with pytest.warns(
        ConfigWarning, match=r"^actor\.engine\.other: ignored: actor\.engine\.backend is 'toy'"
    ):
        assert load(tmp_path, text).actor.engine.options == ToyOptions(bucket_cap_mb=10)
    with pytest.warns(
        ConfigWarning, match=r"^actor\.engine\.toy: ignored: actor\.engine\.backend is 'other'"
    ):
        switched = load(tmp_path, text, ["actor.engine.backend=other"])
    assert switched.actor.engine.options == OtherOptions(shards=4)
    data = unstructure(switched.actor.engine)
    assert list(data)[:2] == ["backend", "other"] and "toy" not in data and "options" not in data
    assert data["other"] == {"shards": 4}


def test_dump_yaml_reads_back_to_the_same_config(tmp_path):
    config = load(tmp_path, overrides=["actor.engine.model.path='1e-5'", "trainer.checkpoint_dir=yes"])
    assert config.actor.engine.model.path == "1e-5"  # a string that looks like a float stays quoted
    dumped = write(tmp_path, "dumped.yaml", dump_yaml(config))
    assert load_config([dumped], registry=REGISTRY) == config
    assert yaml.safe_load(dump_yaml(config)) == unstructure(config)  # YAML 1.1 readers agree


@given(
    key=st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=4).map(
        ".".join
    ),
    value=st.one_of(
        st.integers(),
        st.floats(allow_nan=False),
        st.booleans(),
        st.none(),
        st.text(max_size=10),
        st.lists(st.integers(), max_size=3),
    ),
)
def test_override_values_are_yaml(key, value):
    override = parse_override(f"{key}={dump_yaml(value).removesuffix('...').strip()}")
    assert override.path == key and override.value == value


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # YAML 1.1 reads these as the integers 12, 42 and 90, and 012 as octal 10: YAML 1.2 does not.
        ("1_2", "1_2"),
        ("0_5_2", "0_5_2"),
        ("1:30", "1:30"),
        ("012", 12),
        ("0x1f", 31),
        ("0o17", 15),
        ("-3", -3),
        ("+7", 7),
        ("0.5_2", "0.5_2"),
        ("1e-5", 1e-5),
    ],
)
def test_override_scalars_are_yaml_1_2(text, value):
    override = parse_override(f"actor.policy_loss.rollout_correction.rollout_is_threshold={text}")
    assert override.value == value and type(override.value) is type(value)
    assert yaml.safe_load(dump_yaml(value)) == value  # what is written means the same to a YAML 1.1 reader


def test_a_low_high_bound_written_without_quotes_is_the_bounds_it_reads_as():
    threshold = parse_override("actor.policy_loss.rollout_correction.rollout_is_threshold=1_2").value
    correction = structure({"rollout_is_threshold": threshold}, RolloutCorrectionConfig)
    assert (correction.is_bounds.lower, correction.is_bounds.upper) == (1.0, 2.0)


def test_structure_reports_paths_below_the_given_prefix():
    assert structure({"micro_batch_size": 3}, MicroBatchConfig) == MicroBatchConfig(micro_batch_size=3)
    with pytest.raises(ConfigError) as caught:
        structure({"micro_batch_size": "3"}, MicroBatchConfig, path="critic.engine.micro_batch")
    assert caught.value.errors == [("critic.engine.micro_batch.micro_batch_size", "expected int, got '3'")]


# -- errors ---------------------------------------------------------------------------------------


def test_unknown_key_in_backend_options_suggests_the_close_one(tmp_path):
    errors = errors_of(tmp_path, overrides=["actor.engine.toy.bucket_cap_mbb=4"])
    assert errors == {
        "actor.engine.toy.bucket_cap_mbb": "unknown key (did you mean 'bucket_cap_mb'?) "
        "(from override 'actor.engine.toy.bucket_cap_mbb=4')"
    }


def test_unknown_key_without_close_match_lists_the_allowed_keys(tmp_path):
    errors = errors_of(tmp_path, VALID + "trainer: {zzz: 1}\n")
    message = errors["trainer.zzz"]
    assert message.startswith("unknown key (allowed keys: total_epochs, total_training_steps, save_freq")


def test_wrong_scalar_type_names_the_expected_type_and_the_value(tmp_path):
    errors = errors_of(tmp_path, VALID.replace("lr: 1e-5", "lr: fast"), ["actor.ppo_mini_batch_size=2.5"])
    assert errors == {
        "actor.engine.optim.lr": "expected float, got 'fast'",
        "actor.ppo_mini_batch_size": "expected int, got 2.5 (from override 'actor.ppo_mini_batch_size=2.5')",
    }


def test_yaml_1_1_booleans_are_strings_so_a_bool_field_refuses_them(tmp_path):
    errors = errors_of(tmp_path, VALID + "trainer: {checkpoint_dir: 12}\n", ["data.shuffle=yes"])
    assert errors == {
        "data.shuffle": "expected bool (true or false), got 'yes' (from override 'data.shuffle=yes')",
        "trainer.checkpoint_dir": "expected str, got 12 (quote it to make it a string)",
    }


def test_missing_required_key(tmp_path):
    errors = errors_of(
        tmp_path, VALID.replace("    model: {path: /models/tiny}\n", "    model: {dtype: float32}\n")
    )
    assert errors == {
        "actor.engine.model.path": "required key is missing: set it in the YAML file or with an override"
    }
    errors = errors_of(tmp_path, "data: {seed: 1}\n")
    assert errors.pop("actor") == "required key is missing: set it in the YAML file or with an override"
    # Without an actor, the rules that need none still run: the default estimator needs a critic.
    assert list(errors) == ["critic.enable"]


def test_bad_literal_lists_the_allowed_values(tmp_path):
    errors = errors_of(tmp_path, overrides=["actor.policy_loss.loss_agg_mode=token_mean"])
    allowed = ", ".join(map(repr, typing.get_args(LossAggMode)))
    assert errors == {
        "actor.policy_loss.loss_agg_mode": f"expected one of {allowed}; got 'token_mean' (did you mean "
        "'token-mean'?) (from override 'actor.policy_loss.loss_agg_mode=token_mean')"
    }


def test_a_bad_rollout_dtype_names_the_key_the_dtypes_and_the_close_one(tmp_path):
    errors = errors_of(tmp_path, overrides=["rollout.dtype=bf16"])
    assert errors == {
        "rollout.dtype": "expected one of 'float32', 'bfloat16', 'float16'; got 'bf16' (did you mean "
        "'bfloat16'?) (from override 'rollout.dtype=bf16')"
    }


dtypes = st.sampled_from(typing.get_args(DtypeName))


@given(actor=dtypes, rollout=st.none() | dtypes)
def test_the_rollout_model_is_the_actors_in_rollout_dtype(actor, rollout):
    overrides = [f"actor.engine.model.dtype={actor}", f"rollout.dtype={rollout or 'null'}"]
    config = load_config([], [*OVERRIDES, *overrides], registry=REGISTRY)
    assert config.rollout.dtype == rollout
    assert config.rollout_model == attrs.evolve(config.actor.engine.model, dtype=rollout or actor)
    if rollout in (None, actor):
        assert config.rollout_model is config.actor.engine.model


def test_wrong_types_in_lists_and_tuples_name_the_index(tmp_path):
    errors = errors_of(
        tmp_path,
        VALID.replace("[a.jsonl, b.jsonl]", "[a.jsonl, 3, {x: 1}]"),
        ["actor.engine.optim.betas=[0.9]", "trainer.logger=console"],
    )
    assert errors == {
        "data.train_files[1]": "expected str, got 3 (quote it to make it a string)",
        "data.train_files[2]": "expected str, got {'x': 1}",
        "actor.engine.optim.betas": "expected a list of 2 items, got 1: [0.9] "
        "(from override 'actor.engine.optim.betas=[0.9]')",
        "trainer.logger": "expected a list, got 'console' (a list of one: [console]) "
        "(from override 'trainer.logger=console')",
    }


def test_unknown_backend_lists_installed_ones_at_the_backend_key(tmp_path):
    errors = errors_of(tmp_path, overrides=["actor.engine.backend=tyo", "data.seed=x"])
    assert set(errors) == {"actor.engine.backend", "data.seed"}  # reported together with the others
    message = errors["actor.engine.backend"]
    assert message.startswith(
        "Unknown engine backend 'tyo' (did you mean 'toy'?). Installed engine backends: toy (no distribution), "
        "other (no distribution)."
    )
    assert "(did you mean 'toy'?)" in message and "\n" not in message
    assert message.endswith("(from override 'actor.engine.backend=tyo')")
    fsdp = errors_of(tmp_path, overrides=["actor.engine.backend=fsdp"])["actor.engine.backend"]
    assert 'pip install "verl-core[fsdp]"' in fsdp or "verl-fsdp-plugin" in fsdp


def test_section_named_like_no_installed_backend_is_an_unknown_key(tmp_path):
    errors = errors_of(
        tmp_path, VALID.replace("    toy: {bucket_cap_mb: 10}\n", "    tyo: {bucket_cap_mb: 10}\n")
    )
    assert errors == {"actor.engine.tyo": "unknown key (did you mean 'toy'?)"}
    errors = errors_of(tmp_path, overrides=["actor.engine.options={bucket_cap_mb: 1}"])
    assert errors["actor.engine.options"].startswith(
        "unknown key: the options of backend 'toy' go under its name (toy: {...})"
    )


def test_backend_options_are_validated_at_their_path(tmp_path):
    errors = errors_of(tmp_path, overrides=["actor.engine.toy={bucket_cap_mb: 0, mode: fast}"])
    origin = " (from override 'actor.engine.toy={bucket_cap_mb: 0, mode: fast}')"
    assert errors == {  # the fields that structured are validated too: one run reports both
        "actor.engine.toy.mode": "expected one of 'sync', 'async'; got 'fast'" + origin,
        "actor.engine.toy.bucket_cap_mb": "'bucket_cap_mb' must be > 0: 0" + origin,
    }
    errors = errors_of(tmp_path, overrides=["actor.engine.toy.bucket_cap_mb=0", "actor.engine.other=3"])
    assert errors == {  # attrs' own validator message; the section of another backend is not checked
        "actor.engine.toy.bucket_cap_mb": "'bucket_cap_mb' must be > 0: 0 "
        "(from override 'actor.engine.toy.bucket_cap_mb=0')"
    }
    errors = errors_of(tmp_path, overrides=["actor.engine.toy=[1]"])
    assert errors == {
        "actor.engine.toy": "expected a mapping of ToyOptions keys, got [1] (from override 'actor.engine.toy=[1]')"
    }


def test_range_and_cross_field_rules_are_all_reported_with_paths(tmp_path):
    errors = errors_of(
        tmp_path,
        overrides=[
            "actor.policy_loss.clip_ratio_c=0.5",
            "actor.engine.micro_batch.micro_batch_size=0",
            "actor.engine.optim.betas=[0.9, 1.0]",
            "actor.ppo_mini_batch_size=3",
            "rollout.n=1",
            "critic.enable=true",
            "trainer.resume_mode=resume_path",
        ],
    )
    origin = " (from override '{}')".format
    # Rules across sections run together with everything else, on the values that are valid.
    assert errors == {
        "actor.policy_loss.clip_ratio_c": "must be > 1, got 0.5"
        + origin("actor.policy_loss.clip_ratio_c=0.5"),
        "actor.engine.micro_batch.micro_batch_size": "must be > 0, got 0"
        + origin("actor.engine.micro_batch.micro_batch_size=0"),
        "actor.engine.optim.betas[1]": "must be in [0, 1), got 1.0"
        + origin("actor.engine.optim.betas=[0.9, 1.0]"),
        "critic.engine": "required when critic.enable is true: give it backend and model like actor.engine",
        "trainer.resume_from_path": "required when resume_mode is 'resume_path': set the checkpoint to resume",
        "actor.ppo_mini_batch_size": "must divide data.train_batch_size (8) into whole mini-batches, got 3"
        + origin("actor.ppo_mini_batch_size=3"),
        "rollout.n": "adv_estimator 'grpo' compares the responses to each prompt: set rollout.n >= 2"
        + origin("rollout.n=1"),
    }
    gae = errors_of(tmp_path, overrides=["algorithm.adv_estimator=gae"])
    assert gae["critic.enable"].startswith(
        "adv_estimator 'gae' needs a critic's values: set critic.enable=true"
    )


def test_section_that_is_not_a_mapping(tmp_path):
    assert errors_of(tmp_path, VALID + "trainer: 5\n") == {
        "trainer": "expected a mapping of TrainerConfig keys, got 5"
    }


def test_errors_name_the_file_that_set_the_value(tmp_path):
    first = write(tmp_path, "base.yaml", VALID)
    second = write(tmp_path, "more.yaml", "rollout: {top_p: 0}\n")
    with pytest.raises(ConfigError) as caught:
        load_config([first, second], registry=REGISTRY)
    assert caught.value.source == f"{first}, {second}"
    assert caught.value.errors == [("rollout.top_p", f"must be in (0, 1], got 0.0 (from {second})")]
    assert str(caught.value).splitlines()[0] == f"1 error(s) in the configuration in {first}, {second}:"


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "broken.yaml", "actor:\n  engine:\n    backend: toy\n   model: x\n")
    with pytest.raises(ConfigError) as caught:
        load_config([path], registry=REGISTRY)
    assert caught.value.source == path
    ((where, message),) = caught.value.errors
    assert where == "" and message.startswith("YAML syntax error at line 4, column 4:")
    assert path in str(caught.value)


def test_duplicate_yaml_key_is_an_error_with_its_line(tmp_path):
    path = write(tmp_path, "dup.yaml", VALID + "data: {seed: 1}\n")
    with pytest.raises(ConfigError) as caught:
        load_config([path], registry=REGISTRY)
    assert caught.value.errors == [
        (
            "",
            "YAML syntax error at line 11, column 1: duplicate key 'data' "
            "(while reading a mapping started at line 1)",
        )
    ]


def test_missing_file_and_non_mapping_file_are_named(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config([str(tmp_path / "nope.yaml")], registry=REGISTRY)
    assert caught.value.source == str(tmp_path / "nope.yaml")
    assert caught.value.errors == [("", "cannot read the config file: No such file or directory")]
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config([write(tmp_path, "list.yaml", "- a\n")], registry=REGISTRY)


def test_malformed_overrides_are_all_named(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load(
            tmp_path,
            overrides=[
                "actor.optim.lr",
                "a..b=1",
                "x=[1,",
                "data.train_files[5]=e",
                "data.train_batch_size.x=1",
            ],
        )
    assert caught.value.source == "overrides"
    assert caught.value.errors == [
        ("", "override 'actor.optim.lr' has no '=': write key=value, e.g. actor.engine.optim.lr=1e-5"),
        (
            "",
            "override 'a..b=1': 'a..b' is not a dotted key such as actor.engine.optim.lr or data.train_files[0]",
        ),
        (
            "",
            "override 'x=[1,': the value is not valid YAML (YAML syntax error at line 1, column 4: expected "
            "the node content, but found '<stream end>' (while parsing a flow node started at line 1)); quote it",
        ),
        (
            "",
            "override 'data.train_files[5]=e': index 5 is past the end of a list of 2 item(s); use [2] to append",
        ),
        ("", "override 'data.train_batch_size.x=1': data.train_batch_size is 8, not a section"),
    ]


def test_override_with_an_unknown_path_names_the_override(tmp_path):
    errors = errors_of(tmp_path, overrides=["actor.engine.modle.path=/m", "trainer.total_epoch=2"])
    assert errors == {
        "actor.engine.modle": "unknown key (did you mean 'model'?) (from override 'actor.engine.modle.path=/m')",
        "trainer.total_epoch": "unknown key (did you mean 'total_epochs'?) (from override 'trainer.total_epoch=2')",
    }


# -- names: every one resolved while the config loads ------------------------------------------------


def test_an_unknown_estimator_is_named_at_its_key_with_the_close_match(tmp_path):
    errors = errors_of(tmp_path, overrides=["algorithm.adv_estimator=gpro"])
    message = errors.pop("algorithm.adv_estimator")
    assert errors == {}  # the rules that need the estimator are skipped, not run on a guess
    assert message.startswith(
        "Unknown advantage estimator 'gpro' (did you mean 'grpo'?). Installed advantage estimators: gae "
    )
    assert "(did you mean 'grpo'?)" in message and "\n" not in message
    assert message.endswith("(from override 'algorithm.adv_estimator=gpro')")


def test_every_named_component_of_a_file_is_looked_up_at_its_key(tmp_path):
    text = (
        VALID.replace(
            "  ppo_mini_batch_size: 4\n", "  ppo_mini_batch_size: 4\n  policy_loss: {loss_mode: vanila}\n"
        )
        .replace("    model: {path: /models/tiny}\n", "    model: {path: /models/tiny}\n    device: gpu\n")
        .replace("algorithm: {adv_estimator: grpo}", "algorithm: {adv_estimator: grpo, kl_penalty: k4}")
        .replace("rollout: {n: 2}", "rollout: {n: 2, backend: hff}")
    ) + "reward: {function: exact_mach}\n"
    errors = errors_of(tmp_path, text, ["actor.policy_loss.kl_loss_type=lowvar_kl"])
    assert set(errors) == {
        "actor.policy_loss.loss_mode",
        "actor.policy_loss.kl_loss_type",
        "actor.engine.device",
        "algorithm.kl_penalty",
        "rollout.backend",
        "reward.function",
    }
    assert "(did you mean 'vanilla'?)" in errors["actor.policy_loss.loss_mode"]
    assert "(did you mean 'low_var_kl'?)" in errors["actor.policy_loss.kl_loss_type"]
    assert errors["actor.engine.device"].endswith("use one of auto, cpu, cuda, cuda:N, npu, xpu, mps")
    assert errors["algorithm.kl_penalty"].startswith("unknown KL estimator 'k4'")
    assert (
        "Unknown rollout backend 'hff'" in errors["rollout.backend"]
        and "(did you mean 'hf'?)" in errors["rollout.backend"]
    )
    assert "(did you mean 'exact_match'?)" in errors["reward.function"]
    assert all("\n" not in message for message in errors.values())


def test_the_defaults_resolve_to_core_builtins(tmp_path):
    config = load(tmp_path)
    assert (config.rollout.backend, config.reward) == ("hf", RewardConfig("exact_match", "fail"))
    assert type(config.rollout.options).__name__ == "HFRolloutConfig"


# -- rules across sections: they run on what structured ----------------------------------------------


def test_rules_across_sections_run_when_another_section_has_errors(tmp_path):
    errors = errors_of(
        tmp_path, overrides=["data.seed=x", "actor.ppo_mini_batch_size=3", "algorithm.gamma=2"]
    )
    origin = " (from override '{}')".format
    assert errors == {
        "data.seed": "expected int, got 'x'" + origin("data.seed=x"),
        "algorithm.gamma": "must be in [0, 1], got 2.0" + origin("algorithm.gamma=2"),
        "actor.ppo_mini_batch_size": "must divide data.train_batch_size (8) into whole mini-batches, got 3"
        + origin("actor.ppo_mini_batch_size=3"),
    }


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # A rule reading a value with an error of its own is skipped (no division by zero, no
        # second message at the same key): that value's error says what to fix.
        (["data.train_batch_size=0", "actor.ppo_mini_batch_size=3"], {"data.train_batch_size"}),
        (["actor.ppo_mini_batch_size=0"], {"actor.ppo_mini_batch_size"}),
        (["rollout.n=0"], {"rollout.n"}),
        (["algorithm.adv_estimator=gea"], {"algorithm.adv_estimator"}),  # no "gae needs a critic"
        (["critic=5", "algorithm.adv_estimator=gae"], {"critic"}),
        # A section that did not structure at all: the rules that need it are skipped, the others run.
        (["actor=5", "rollout.n=1"], {"actor", "rollout.n"}),
        (["actor.engine.backend=nope", "rollout.n=1"], {"actor.engine.backend", "rollout.n"}),
    ],
)
def test_a_rule_whose_inputs_have_errors_is_skipped(tmp_path, overrides, expected):
    assert set(errors_of(tmp_path, overrides=overrides)) == expected


def test_a_rule_that_reads_a_field_which_does_not_exist_is_still_an_error():
    @attrs.define
    class Typo:
        size: int = 1

        def check(self):
            if self.sise > 1:  # a bug in the rule, not an unstructured input: it must not be hidden
                yield "size", "too big"

    with pytest.raises(ConfigError) as caught:
        structure({"size": 2}, Typo)
    assert caught.value.errors == [("", "AttributeError: 'Typo' object has no attribute 'sise'")]


# -- floats are finite -------------------------------------------------------------------------------


def test_infinite_and_nan_floats_are_refused_at_their_key(tmp_path):
    overrides = [
        "actor.engine.optim.lr=.inf",
        "actor.engine.optim.betas=[0.9, .nan]",
        "rollout.temperature=.NaN",
        "algorithm.kl_ctrl.kl_coef=-.inf",
        "actor.policy_loss.clip_ratio_high=.inf",
    ]
    errors = errors_of(tmp_path, overrides=overrides)
    origin = " (from override '{}')".format
    assert errors == {
        "actor.engine.optim.lr": "expected a finite float, got inf" + origin(overrides[0]),
        "actor.engine.optim.betas[1]": "expected a finite float, got nan" + origin(overrides[1]),
        "rollout.temperature": "expected a finite float, got nan" + origin(overrides[2]),
        "algorithm.kl_ctrl.kl_coef": "expected a finite float, got -inf" + origin(overrides[3]),
        "actor.policy_loss.clip_ratio_high": "expected a finite float, got inf" + origin(overrides[4]),
    }
    assert errors_of(tmp_path, VALID.replace("lr: 1e-5", "lr: .inf")) == {
        "actor.engine.optim.lr": "expected a finite float, got inf"
    }
    too_large = errors_of(tmp_path, overrides=["actor.engine.optim.lr=" + "9" * 400])
    assert too_large["actor.engine.optim.lr"].startswith("expected a finite float, got 999")


# -- options the run will ignore ---------------------------------------------------------------------


def test_options_the_run_ignores_warn_at_their_key_with_where_they_were_set(tmp_path):
    overrides = [
        "trainer.resume_from_path=/ckpt/step_10",
        "actor.engine.other={shards: 2}",
        "ref.engine={backend: toy, model: {path: /models/ref}}",
        "critic.engine={backend: other, model: {path: /models/critic}}",
    ]
    with pytest.warns(ConfigWarning) as caught:
        config = load(tmp_path, overrides=overrides)
    assert config.actor.engine.options == ToyOptions(bucket_cap_mb=10)  # still loads
    origin = " (from override '{}')".format
    assert sorted(str(warning.message) for warning in caught) == sorted(
        [
            "trainer.resume_from_path: ignored: resume_mode is 'auto'; set trainer.resume_mode=resume_path "
            "to resume from this checkpoint, or remove it" + origin(overrides[0]),
            "actor.engine.other: ignored: actor.engine.backend is 'toy'; the options of backend 'other' "
            "apply once actor.engine.backend=other" + origin(overrides[1]),
            "ref.engine: ignored: no KL term is on (actor.policy_loss.use_kl_loss and "
            "algorithm.use_kl_in_reward are false), so no reference policy runs; turn one on, or remove "
            "ref.engine" + origin(overrides[2]),
            "critic.engine: ignored: critic.enable is false, so no critic is trained; set "
            "critic.enable=true to train one, or remove critic.engine" + origin(overrides[3]),
        ]
    )
    assert all(warning.category is ConfigWarning for warning in caught)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt"],
        ["ref.engine={backend: toy, model: {path: /ref}}", "actor.policy_loss.use_kl_loss=true"],
        ["ref.engine={backend: toy, model: {path: /ref}}", "algorithm.use_kl_in_reward=true"],
        ["critic.enable=true", "critic.engine={backend: toy, model: {path: /critic}}"],
    ],
)
def test_options_the_run_uses_do_not_warn(tmp_path, overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load(tmp_path, overrides=overrides)


def test_a_config_with_errors_reports_the_errors_only(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        errors = errors_of(tmp_path, overrides=["trainer.resume_from_path=/ckpt", "rollout.n=0"])
    assert list(errors) == ["rollout.n"]


def test_structure_warns_about_another_backends_section_too():
    data = {"backend": "toy", "other": {"shards": 2}, "model": {"path": "/m"}}
    with pytest.warns(
        ConfigWarning, match=r"^actor\.engine\.other: ignored: actor\.engine\.backend is 'toy'"
    ):
        structure(data, EngineConfig, "actor.engine", registry=REGISTRY)


# -- the decay length: from the run length ------------------------------------------------------------


def test_total_steps_0_of_a_decaying_schedule_is_the_run_length_in_optimiser_steps(tmp_path):
    overrides = [
        "actor.engine.optim.lr_scheduler=cosine",
        "trainer.total_training_steps=30",
        "actor.policy_loss.use_kl_loss=true",
        "ref.engine={backend: toy, model: {path: /ref}, optim: {lr_scheduler: linear, lr_warmup_steps: 3}}",
        "critic.enable=true",
        "critic.engine={backend: toy, model: {path: /critic}, optim: {lr_scheduler: linear, total_steps: 50}}",
    ]
    loaded = load(tmp_path, overrides=overrides)
    assert loaded.actor.engine.optim.total_steps == 0  # what `verl-core config` prints: the trainer fills it
    config = fill_total_steps(loaded, 30, updates_per_step=4)  # e.g. 2 mini-batches x 2 epochs
    assert config.actor.engine.optim.total_steps == 120
    assert config.ref.engine.optim.total_steps == 120
    assert config.critic.engine.optim.total_steps == 50  # set: kept
    assert fill_total_steps(loaded).actor.engine.optim.total_steps == 30  # trainer.total_training_steps
    constant = load(tmp_path, overrides=["trainer.total_training_steps=30"])
    assert fill_total_steps(constant, 30).actor.engine.optim.total_steps == 0  # nothing decays
    by_epochs = load(tmp_path, overrides=["actor.engine.optim.lr_scheduler=cosine"])
    assert fill_total_steps(by_epochs) == by_epochs  # no run length known yet: nothing filled


def test_a_decay_must_outlast_the_warmup(tmp_path):
    warmup = ["actor.engine.optim.lr_scheduler=linear", "actor.engine.optim.lr_warmup_steps=40"]
    with pytest.raises(ConfigError) as caught:
        fill_total_steps(load(tmp_path, overrides=warmup), 30)
    assert dict(caught.value.errors) == {
        "actor.engine.optim.total_steps": "30: lr_scheduler 'linear' decays after the warmup until total_steps, "
        "which must exceed lr_warmup_steps (40), filled in from the run's length for total_steps: 0 (its "
        "optimiser steps: trainer steps x updates per step)"
    }
    errors = errors_of(tmp_path, overrides=[*warmup, "actor.engine.optim.total_steps=40"])
    assert errors == {
        "actor.engine.optim.total_steps": "40: lr_scheduler 'linear' decays after the warmup until total_steps, "
        "which must exceed lr_warmup_steps (40) (from override 'actor.engine.optim.total_steps=40')"
    }


# -- inputs that are not what they look like ----------------------------------------------------------


def test_a_file_that_is_not_utf_8_names_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(VALID.encode() + "data: {prompt_key: café}\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_config([path], registry=REGISTRY)
    assert caught.value.source == str(path)
    offset = len(VALID.encode()) + len(b"data: {prompt_key: caf")
    assert caught.value.errors == [
        (
            "",
            f"the config file is not UTF-8 text: byte 0xe9 at offset {offset} is not valid UTF-8 "
            "(invalid continuation byte); save the file as UTF-8",
        )
    ]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("actor.engine.optim.lr", True),
        ("trainer.total_training_steps", True),
        ("data.train_files[0]", True),
        ("rollout", True),
        ("run.yaml", False),
        ("trainer.yaml", False),
        ("configs/actor.engine", False),
        ("my.settings", False),
    ],
)
def test_what_looks_like_a_key_where_a_file_was_expected(text, key):
    from verl_core.config.loading import looks_like_key

    assert looks_like_key(text) is key


# -- the classes themselves ------------------------------------------------------------------------


def test_validators_also_guard_configs_built_in_python():
    with pytest.raises(InvalidValue, match="micro_batch_size: must be > 0, got 0"):
        MicroBatchConfig(micro_batch_size=0)
    optim = OptimConfig()
    with pytest.raises(InvalidValue, match=r"betas\[0\]: must be in \[0, 1\), got 1.5"):
        optim.betas = (1.5, 0.9)


def test_validators_stay_on_in_other_threads_while_a_config_is_structured():
    entered, release = threading.Event(), threading.Event()

    def wait_for_release(instance, attribute, value):  # holds the structuring thread inside structure()
        entered.set()
        release.wait(timeout=10)

    @attrs.define
    class SlowOptions:
        value: int = attrs.field(default=0, validator=wait_for_release)

    with ThreadPoolExecutor(max_workers=1) as pool:
        structured = pool.submit(structure, {"value": 1}, SlowOptions)
        try:
            assert entered.wait(timeout=10)
            with pytest.raises(InvalidValue, match="lr: must be >= 0, got -1"):
                OptimConfig(lr=-1)
        finally:
            release.set()
        assert structured.result(timeout=10) == SlowOptions(value=1)


def test_loss_aggregation_modes_match_the_algorithms():
    from verl_core.algos.aggregation import LOSS_AGG_MODES

    assert typing.get_args(LossAggMode) == LOSS_AGG_MODES


def test_importing_the_config_package_does_not_import_torch():
    code = "import sys, verl_core.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def documented_tables() -> dict[str, dict[str, str]]:
    """``### `section``` heading -> {key: default column} of the table below it in docs/config.md."""
    markdown = (REPO / "docs" / "config.md").read_text()
    tables = {}
    for chunk in markdown.split("\n### `")[1:]:
        title, _, body = chunk.partition("`")
        tables[title] = dict(re.findall(r"^\| `([^`<]+)` \| ([^|]+?) \|", body, re.MULTILINE))
    return tables


def documented_default(field: attrs.Attribute) -> str:
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):
        default = default.factory()
    if attrs.has(type(default)):
        return "section"
    flow = yaml.safe_dump(unstructure(default), default_flow_style=True).strip().removesuffix("...").strip()
    return f"`{flow}`"


def test_docs_list_every_key_with_its_default():
    sections = {
        "actor": ActorConfig,
        "actor.policy_loss": PolicyLossConfig,
        "actor.policy_loss.rollout_correction": RolloutCorrectionConfig,
        "ref": RefConfig,
        "critic": CriticConfig,
        "critic.loss": CriticLossConfig,
        "rollout": RolloutConfig,
        "rollout.hf": HFRolloutConfig,
        "rollout.agent": AgentConfig,
        "reward": RewardConfig,
        "algorithm": AlgorithmConfig,
        "algorithm.kl_ctrl": KLControlConfig,
        "algorithm.filter_groups": FilterGroupsConfig,
        "data": DataConfig,
        "trainer": TrainerConfig,
        "async_training": AsyncTrainingConfig,
        "distillation": DistillationConfig,
        "distillation.teachers.<name>": TeacherConfig,
        "<engine>": EngineConfig,
        "<engine>.model": ModelConfig,
        "<engine>.optim": OptimConfig,
        "<engine>.micro_batch": MicroBatchConfig,
    }
    tables = documented_tables()
    assert set(tables) == set(sections)
    for title, cls in sections.items():
        # A backend's options sit under its name (``fsdp: {...}``), documented with the backend.
        backend_options = cls in (EngineConfig, RolloutConfig)
        expected = {
            field.name: documented_default(field)
            for field in attrs.fields(cls)
            if not (backend_options and field.name == "options")
        }
        assert tables[title] == expected, f"docs/config.md, section {title}"


# -- the example ----------------------------------------------------------------------------------


def test_example_grpo_config_loads_with_the_installed_ddp_backend():
    registry = get_registry()
    if "ddp" not in registry.names("engine_backends"):
        pytest.skip("the ddp backend (plugins/verl_ddp) is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # the example sets nothing the run ignores
        config = load_config([REPO / "examples" / "grpo_tiny_ddp.yaml"], registry=registry)
    assert config.actor.engine.backend == "ddp"
    assert type(config.actor.engine.options).__name__ == "DDPConfig"
    assert config.algorithm.adv_estimator == "grpo" and config.rollout.n >= 2
    assert load_config([REPO / "examples" / "grpo_tiny_ddp.yaml"], registry=registry) == structure(
        unstructure(config), RunConfig, registry=registry
    )


def test_example_grpo_config_builds_an_optimiser_schedule():
    """Its cosine schedule decays over ``total_steps: 0``, the run's length: filled in as the trainer
    does, the engine's own check of the schedule passes."""
    from verl_core.toolkit import validate_optim_config

    registry = get_registry()
    if "ddp" not in registry.names("engine_backends"):
        pytest.skip("the ddp backend (plugins/verl_ddp) is not installed")
    config = fill_total_steps(load_config([REPO / "examples" / "grpo_tiny_ddp.yaml"], registry=registry))
    optim = config.actor.engine.optim
    assert (optim.lr_scheduler, optim.total_steps) == ("cosine", config.trainer.total_training_steps)
    validate_optim_config(optim)  # raises ConfigError on the file as shipped before the fill


def test_an_sft_config_is_not_held_to_the_rl_rules(tmp_path):
    """SFT reads no estimator, rollout group or PPO mini-batch: the default estimator gae without a
    critic, or a mini-batch that does not divide the batch, is fine there (and refused for RL)."""
    overrides = ["data.train_batch_size=6", "actor.ppo_mini_batch_size=4", "algorithm.adv_estimator=gae"]
    errors = errors_of(tmp_path, overrides=overrides)
    assert {"critic.enable", "actor.ppo_mini_batch_size"} <= set(errors)
    path = write(tmp_path, "sft.yaml", VALID)
    config = load_config([path], overrides, registry=REGISTRY, rl_rules=False)
    assert config.algorithm.adv_estimator == "gae" and not config.critic.enable


def test_in_process_workers_say_they_ignore_the_ray_settings(tmp_path):
    # Warnings, so that trainer.workers=in_process alone switches a config written for Ray.
    with pytest.warns(
        ConfigWarning, match=r"^trainer\.world_size: ignored: in-process workers run one rank, not 2"
    ):
        load(tmp_path, VALID, ["trainer.workers=in_process", "trainer.world_size=2"])
    with pytest.warns(
        ConfigWarning, match=r"^trainer\.ray_address: ignored: trainer\.workers is 'in_process'"
    ):
        load(tmp_path, VALID, ["trainer.workers=in_process", "trainer.ray_address=10.0.0.1:6379"])


def test_an_existing_cluster_keeps_its_own_object_store(tmp_path):
    with pytest.warns(
        ConfigWarning,
        match=r"^trainer\.ray_object_store_megabytes: ignored: the cluster at trainer\.ray_address has its own",
    ):
        load(
            tmp_path, VALID, ["trainer.ray_address=10.0.0.1:6379", "trainer.ray_object_store_megabytes=1024"]
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load(tmp_path, VALID, ["trainer.ray_object_store_megabytes=1024"])
