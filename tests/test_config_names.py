"""Component names resolve while a config loads: estimators, losses, KL estimators, devices, rollout
backends (with their options) and reward functions (registered, or a function in a user's file).

Each error is asserted at its full dotted path, in one line, with what is installed and the close
match. The test plugins here provide every name looked up: nothing depends on core's built-in
rollout or rewards being registered.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_core import AdvantageEstimator, EngineBackend, RewardFunction, RolloutBackend, hookimpl
from verl_core.config import (
    AlgorithmConfig,
    EngineConfig,
    ModelConfig,
    PolicyLossConfig,
    RewardConfig,
    RolloutConfig,
    structure,
    unstructure,
)
from verl_core.config.algorithm import KL_ESTIMATORS, KL_PENALTIES
from verl_core.config.names import file_function_problem, is_file_spec, top_level_names
from verl_core.config.validators import DEVICE_NAMES, InvalidValue
from verl_core.errors import ConfigError, ConfigWarning
from verl_core.plugins import Registry


@attrs.define
class ToyRolloutOptions:
    max_batch: int = attrs.field(default=8, validator=attrs.validators.gt(0))
    temperature_floor: float = 0.0


@attrs.define
class FastRolloutOptions:
    page_size: int = 16


@attrs.define
class ToyEngineOptions:
    buckets: int = 1


def toy_reward(prompt: str, response: str, extra: dict) -> float:
    return float(response == extra.get("ground_truth"))


class NamesPlugin:
    @staticmethod
    @hookimpl
    def verl_engine_backends() -> list[EngineBackend]:
        return [
            EngineBackend(
                name="toy", engine="fixtures.engines:Engine", config=ToyEngineOptions, api_version=1
            )
        ]

    @staticmethod
    @hookimpl
    def verl_rollout_backends() -> list[RolloutBackend]:
        return [
            RolloutBackend(name="toyroll", rollout="fixtures.engines:Engine", config=ToyRolloutOptions),
            RolloutBackend(name="fastroll", rollout="fixtures.engines:Engine", config=FastRolloutOptions),
        ]

    @staticmethod
    @hookimpl
    def verl_reward_functions() -> list[RewardFunction]:
        return [
            RewardFunction(name="toy_reward", function=toy_reward),
            RewardFunction(name="length_penalty", function=toy_reward),
        ]

    @staticmethod
    @hookimpl
    def verl_advantage_estimators() -> list[AdvantageEstimator]:
        return [AdvantageEstimator(name="scaled_outcome", function="fixtures.engines:Engine")]


REGISTRY = Registry.from_plugins([NamesPlugin])


def errors_of(data: dict, cls: type, path: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        structure(data, cls, path, registry=REGISTRY)
    return dict(caught.value.errors)


# -- registered names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "path", "key", "typo", "meant", "installed"),
    [
        (
            AlgorithmConfig,
            "algorithm",
            "adv_estimator",
            "gpro",
            "grpo",
            "Installed advantage estimators: gae",
        ),
        (PolicyLossConfig, "actor.policy_loss", "loss_mode", "vanila", "vanilla", "Installed policy losses:"),
        (RolloutConfig, "rollout", "backend", "toyrol", "toyroll", "toyroll (no distribution), fastroll"),
        (RewardConfig, "reward", "function", "toy_rewrd", "toy_reward", "Installed reward functions:"),
    ],
)
def test_an_unknown_registered_name_is_one_line_at_its_path(cls, path, key, typo, meant, installed):
    errors = errors_of({key: typo}, cls, path)
    message = errors.pop(f"{path}.{key}")
    assert errors == {}
    assert "\n" not in message
    assert installed in message and f"(did you mean '{meant}'?)" in message
    assert "verl-core plugins --all" in message  # the registry's own advice, kept


def test_registered_names_of_plugins_resolve():
    assert structure(
        {"adv_estimator": "scaled_outcome"}, AlgorithmConfig, registry=REGISTRY
    ).adv_estimator == ("scaled_outcome")
    assert (
        structure({"function": "length_penalty"}, RewardConfig, registry=REGISTRY).function
        == "length_penalty"
    )


def test_an_unknown_reward_name_also_offers_a_file():
    message = errors_of({"function": "nope"}, RewardConfig, "reward")["reward.function"]
    assert message.endswith("Or name a function in your own file: path/to/file.py:function_name.")


def test_a_conflicting_name_reports_both_providers_at_its_path():
    class Clash:
        @staticmethod
        @hookimpl
        def verl_reward_functions() -> list[RewardFunction]:
            return [RewardFunction(name="toy_reward", function=toy_reward)]

    registry = Registry.from_plugins([NamesPlugin, Clash])
    with pytest.raises(ConfigError) as caught:
        structure({"function": "toy_reward"}, RewardConfig, "reward", registry=registry)
    ((path, message),) = caught.value.errors
    assert path == "reward.function"
    assert "plugin 'NamesPlugin'" in message and "plugin 'Clash'" in message and "override=True" in message


def test_names_are_not_looked_up_for_configs_built_in_python():
    assert AlgorithmConfig(adv_estimator="anything").adv_estimator == "anything"  # needs no registry


# -- KL estimators and devices: fixed lists, checked without torch -----------------------------------


@pytest.mark.parametrize(
    ("cls", "path", "key"),
    [(PolicyLossConfig, "actor.policy_loss", "kl_loss_type"), (AlgorithmConfig, "algorithm", "kl_penalty")],
)
def test_an_unknown_kl_estimator_lists_them_at_its_path(cls, path, key):
    errors = errors_of({key: "lowvar_kl"}, cls, path)
    assert errors == {
        f"{path}.{key}": "unknown KL estimator 'lowvar_kl' (did you mean 'low_var_kl'?); use one of "
        + ", ".join(KL_PENALTIES)
        + "; '+' keeps the value with the gradient of k2"
    }
    for name in KL_PENALTIES:
        assert getattr(structure({key: name}, cls, registry=REGISTRY), key) == name
    with pytest.raises(InvalidValue, match="unknown KL estimator 'k4'"):
        cls(**{key: "k4"})


def test_the_kl_names_of_the_config_are_the_estimators_of_the_algorithms():
    torch = pytest.importorskip("torch")
    from verl_core.algos import kl

    assert set(kl._ESTIMATORS) == set(KL_ESTIMATORS)
    assert kl.KL_PENALTIES is KL_PENALTIES
    log_prob, ref_log_prob = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    for name in KL_PENALTIES:  # each name the config accepts computes
        assert kl.kl_penalty(log_prob, ref_log_prob, name).shape == (2,)
    with pytest.raises(ValueError, match="unknown KL penalty 'k4'"):
        kl.kl_penalty(log_prob, ref_log_prob, "k4")


ENGINE = {"backend": "toy", "model": {"path": "/m"}}


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:7", "npu", "xpu", "mps"])
def test_devices_that_engines_accept(device):
    assert structure({**ENGINE, "device": device}, EngineConfig, registry=REGISTRY).device == device


@pytest.mark.parametrize("path", ["actor.engine", "ref.engine", "critic.engine"])
@pytest.mark.parametrize("device", ["gpu", "CUDA", "cuda:", "cuda:x", "tpu", "cpu0", ""])
def test_an_unknown_device_lists_the_devices_at_its_path(path, device):
    errors = errors_of({**ENGINE, "device": device}, EngineConfig, path)
    message = errors.pop(f"{path}.device")
    assert errors == {}
    assert message.startswith(f"unknown device {device!r}")
    assert message.endswith("use one of auto, cpu, cuda, cuda:N, npu, xpu, mps")
    assert ", ".join(DEVICE_NAMES) in message


def test_a_device_is_checked_in_python_too():
    with pytest.raises(InvalidValue, match="device: unknown device 'gpu0'"):
        EngineConfig(backend="toy", model=ModelConfig(path="/m"), device="gpu0")


def test_checking_names_imports_no_torch():
    code = textwrap.dedent(
        """
        import sys
        from verl_core.config import AlgorithmConfig, EngineConfig, ModelConfig, PolicyLossConfig, structure
        from verl_core.plugins import get_registry
        structure({"kl_loss_type": "k3+", "loss_mode": "vanilla"}, PolicyLossConfig, registry=get_registry())
        structure({"adv_estimator": "grpo", "kl_penalty": "abs"}, AlgorithmConfig, registry=get_registry())
        EngineConfig(backend="any", model=ModelConfig(path="m"), device="cuda:1")
        assert "torch" not in sys.modules, "torch imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- rollout backends and their options ------------------------------------------------------------


def test_rollout_options_sit_under_the_backend_name():
    rollout = structure(
        {"backend": "toyroll", "toyroll": {"max_batch": 2}, "n": 4}, RolloutConfig, registry=REGISTRY
    )
    assert rollout == RolloutConfig(backend="toyroll", options=ToyRolloutOptions(max_batch=2), n=4)
    data = unstructure(rollout)
    assert list(data)[:2] == ["backend", "toyroll"] and "options" not in data
    assert structure(data, RolloutConfig, registry=REGISTRY) == rollout
    defaults = structure({"backend": "fastroll"}, RolloutConfig, registry=REGISTRY)
    assert defaults.options == FastRolloutOptions()


def test_rollout_options_are_checked_at_their_path():
    errors = errors_of(
        {"backend": "toyroll", "toyroll": {"max_btch": 2, "temperature_floor": ".inf"}},
        RolloutConfig,
        "rollout",
    )
    assert errors == {
        "rollout.toyroll.max_btch": "unknown key (did you mean 'max_batch'?)",
        "rollout.toyroll.temperature_floor": "expected float, got '.inf'",
    }
    errors = errors_of(
        {"backend": "toyroll", "toyroll": {"max_batch": 0}, "tyroll": {}}, RolloutConfig, "rollout"
    )
    assert errors == {
        "rollout.toyroll.max_batch": "'max_batch' must be > 0: 0",
        "rollout.tyroll": "unknown key (did you mean 'toyroll'?)",
    }
    errors = errors_of({"backend": "toyroll", "options": {}}, RolloutConfig, "rollout")
    assert errors["rollout.options"].startswith(
        "unknown key: the options of backend 'toyroll' go under its name"
    )


def test_the_defaults_name_core_builtins_which_resolve():
    from verl_core.rollout.config import HFRolloutConfig

    core = Registry.from_plugins()
    assert structure({}, RolloutConfig, registry=core) == RolloutConfig(
        backend="hf", options=HFRolloutConfig()
    )
    assert structure({}, RewardConfig, registry=core) == RewardConfig(function="exact_match")


def test_another_installed_rollout_backends_section_is_ignored_with_a_warning():
    data = {"backend": "toyroll", "fastroll": {"page_size": 4}}
    with pytest.warns(ConfigWarning) as caught:
        rollout = structure(data, RolloutConfig, "rollout", registry=REGISTRY)
    assert rollout.options == ToyRolloutOptions()
    assert [str(warning.message) for warning in caught] == [
        "rollout.fastroll: ignored: rollout.backend is 'toyroll'; the options of backend 'fastroll' apply "
        "once rollout.backend=fastroll"
    ]
    switched = structure({**data, "backend": "fastroll"}, RolloutConfig, registry=REGISTRY)
    assert switched.options == FastRolloutOptions(page_size=4)


# -- reward functions in user files ----------------------------------------------------------------

REWARD_FILE = """\
import math
from os.path import join as joined

LIMIT = 3
scale: float = 2.0


def score(prompt, response, extra):
    def inner():
        pass
    return 1.0


async def score_async(prompt, response, extra):
    return 1.0


if math.pi > 3:
    def fallback(prompt, response, extra):
        return 0.0

try:
    from json import loads as parse
except ImportError:
    parse = None

exact = score
open("imported.marker", "w").write("the file was imported")
"""


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.mark.parametrize(
    "name", ["score", "score_async", "fallback", "exact", "LIMIT", "scale", "parse", "joined"]
)
def test_a_function_in_a_file_is_found_without_importing_it(reward_file, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reward = structure({"function": f"{reward_file}:{name}"}, RewardConfig, registry=REGISTRY)
    assert reward.function == f"{reward_file}:{name}"
    assert not (tmp_path / "imported.marker").exists()


def test_a_relative_file_is_relative_to_the_working_directory(reward_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        structure({"function": "my_reward.py:score"}, RewardConfig, registry=REGISTRY).function
        == "my_reward.py:score"
    )
    monkeypatch.chdir(tmp_path.parent)
    message = errors_of({"function": "my_reward.py:score"}, RewardConfig, "reward")["reward.function"]
    assert message == (
        f"no such file: my_reward.py (relative to the current working directory, {tmp_path.parent}); "
        "write path/to/file.py:function_name"
    )


def test_a_missing_function_lists_the_functions_of_the_file(reward_file):
    message = errors_of({"function": f"{reward_file}:scor"}, RewardConfig, "reward")["reward.function"]
    assert message == (
        f"{reward_file} defines no top-level function or assignment 'scor' (did you mean 'score'?); "
        "its functions: score, score_async, fallback"
    )
    message = errors_of({"function": f"{reward_file}:inner"}, RewardConfig, "reward")["reward.function"]
    assert "defines no top-level function or assignment 'inner'" in message  # nested: not importable


def test_a_file_spec_that_is_no_file_or_no_python(tmp_path):
    (tmp_path / "folder.py").mkdir()
    (tmp_path / "broken.py").write_text("def score(:\n")
    (tmp_path / "empty.py").write_text("")
    problems = {
        f"{tmp_path}/folder.py:score": f"not a file: {tmp_path}/folder.py; write path/to/file.py:function_name",
        f"{tmp_path}/broken.py:score": f"{tmp_path}/broken.py is not valid Python at line 1: ",
        f"{tmp_path}/empty.py:score": f"{tmp_path}/empty.py defines no top-level function or assignment 'score'; its functions: none",
        f"{tmp_path}/empty.py:": "'' after the last ':' is not a function name: write path/to/file.py:function_name",
        f"{tmp_path}/empty.py:not-a-name": "'not-a-name' after the last ':' is not a function name",
    }
    for spec, start in problems.items():
        message = errors_of({"function": spec}, RewardConfig, "reward")["reward.function"]
        assert message.startswith(start), message


def test_what_counts_as_a_file_spec():
    assert is_file_spec("rewards.py:score") and is_file_spec("C:\\work\\rewards.py:score")
    assert is_file_spec("dir.v2/rewards.py:")  # a file spec, without a function: reported as such
    assert not is_file_spec("exact_match") and not is_file_spec("package.module:score")
    assert not is_file_spec("rewards.py")


def test_a_file_without_a_function_says_to_name_one():
    message = errors_of({"function": "rewards.py"}, RewardConfig, "reward")["reward.function"]
    assert message == "names a file but no function in it: write 'rewards.py:function_name'"


def test_a_file_under_the_home_directory(reward_file, monkeypatch):
    monkeypatch.setenv("HOME", str(reward_file.parent))
    assert file_function_problem("~/my_reward.py:score") is None
    assert file_function_problem("~/my_reward.py:nope").startswith(f"{reward_file} defines no top-level")


@given(st.text(alphabet="ab.py:/\\~ ", max_size=14))
def test_the_config_and_the_reward_loader_agree_on_file_specs(value):
    from verl_core.reward.loading import is_file_spec as loader_is_file_spec

    assert is_file_spec(value) == loader_is_file_spec(value)


def test_on_error_is_fail_or_zero():
    assert structure({"on_error": "zero"}, RewardConfig, registry=REGISTRY).on_error == "zero"
    errors = errors_of({"on_error": "skip"}, RewardConfig, "reward")
    assert errors == {"reward.on_error": "expected one of 'fail', 'zero'; got 'skip'"}
    from verl_core.reward.scoring import ON_ERROR  # what scoring does with a failing sample

    assert typing.get_args(typing.get_type_hints(RewardConfig)["on_error"]) == ON_ERROR


identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True).filter(lambda name: name.isidentifier())


@given(defined=st.lists(identifiers, min_size=1, max_size=5, unique=True), other=identifiers)
def test_top_level_functions_are_found_and_others_are_not(tmp_path_factory, defined, other):
    import ast
    import keyword

    defined = [name for name in defined if not keyword.iskeyword(name)]
    source = "".join(f"def {name}(prompt, response, extra):\n    return 0.0\n" for name in defined)
    functions, bound = top_level_names(ast.parse(source))
    assert functions == bound == defined
    path = tmp_path_factory.mktemp("rewards") / "r.py"
    path.write_text(source)
    for name in defined:
        assert file_function_problem(f"{path}:{name}") is None
    if other not in defined and not keyword.iskeyword(other):
        assert "defines no top-level function or assignment" in file_function_problem(f"{path}:{other}")
