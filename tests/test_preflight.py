"""Everything checkable without a worker is checked before anything starts, all at once, each problem
at its config key: by ``verl-core config`` (exit 2) and by ``train``/``sft`` before Ray or an engine.

Every case is a mistake a new user makes, on the demo's tiny model and data; each failed (or passed
silently until a worker hit it) before these checks existed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from fixtures.demo import build_small_demo, run_overrides

from verl_core.cli import main
from verl_core.config import load_config
from verl_core.errors import ConfigError
from verl_core.plugins import get_registry
from verl_core.trainer.preflight import check_run, trainer_kind

DEMO_SFT = Path(__file__).parents[1] / "examples" / "demo" / "sft.yaml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_small_demo(tmp_path_factory.mktemp("demo"))


def config_errors(capsys, *args: str) -> dict[str, str]:
    """``verl-core config ARGS``: exit 2, and the errors it printed by key."""
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = {}
    for line in err.splitlines():
        key, colon, message = line.strip().partition(": ")
        if colon and not line.startswith(("warning", "verl-core")) and line.startswith("  "):
            errors[key] = message
    return errors


def model_copy(demo, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(demo.model, copy)
    return copy


def test_a_valid_rl_config_passes_and_says_what_it_was_checked_for(demo, tmp_path, capsys) -> None:
    assert main(["config", *run_overrides(demo, tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "actor:" in captured.out
    assert "checked as a config for `verl-core train`" in captured.err


def test_an_sft_config_is_told_from_its_data_and_passes(demo, tmp_path, capsys) -> None:
    """The demo's SFT config has no algorithm section, so the RL rules (gae needs a critic) refused it."""
    overrides = run_overrides(demo, tmp_path, **{"data.train_files": f"[{demo.sft}]", "data.val_files": "[]"})
    overrides = [o for o in overrides if not o.startswith(("algorithm.", "reward.", "rollout.n"))]
    assert main(["config", *overrides]) == 0
    assert "checked as a config for `verl-core sft`" in capsys.readouterr().err
    assert main(["config", "--for", "train", *overrides]) == 2
    assert "critic.enable: adv_estimator 'gae' needs a critic" in capsys.readouterr().err
    # `train` given it says what the config is, beside the rule it broke; a real RL mistake does not.
    assert main(["train", *overrides]) == 2
    assert "this is an SFT config (the rows of data.train_files" in capsys.readouterr().err
    rl_overrides = run_overrides(demo, tmp_path, **{"algorithm.adv_estimator": "gae"})
    assert main(["train", *rl_overrides]) == 2
    assert "SFT config" not in capsys.readouterr().err


def test_the_demo_sft_config_before_its_assets_exist_names_them_not_an_rl_rule(
    tmp_path, capsys, monkeypatch
) -> None:
    """A fresh clone, before make_demo.py: no data to tell SFT from RL. The missing data and model are
    named at their keys, and the RL rule an SFT config need not meet (gae needs a critic) is not."""
    shutil.copy(DEMO_SFT, tmp_path / "sft.yaml")
    monkeypatch.chdir(tmp_path)
    errors = config_errors(capsys, "sft.yaml")
    assert sorted(errors) == ["actor.engine.model.path", "data.train_files[0]"], errors
    assert "'runs/demo/data/sft.jsonl' not found" in errors["data.train_files[0]"]
    assert "'runs/demo/model' does not exist" in errors["actor.engine.model.path"]
    assert main(["config", "sft.yaml"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(
        "verl-core: checked as a config for `verl-core sft`: data.train_files[0] cannot be read"
    )
    # `train` given it still reports the RL rule (it was asked for RL), and that the data cannot tell.
    assert main(["train", "sft.yaml"]) == 2
    err = capsys.readouterr().err
    assert "critic.enable: adv_estimator 'gae' needs a critic" in err
    assert "if this is an SFT config, run it with `verl-core sft`: data.train_files[0] cannot be read" in err
    # A config that meets the RL rules is checked as an RL config, saying the data could not tell.
    assert main(["config", "sft.yaml", "algorithm.adv_estimator=grpo", "rollout.n=4"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("verl-core: checked as a config for `verl-core train`: data.train_files[0] cannot")


def test_train_and_sft_without_a_config_say_how_to_give_one(capsys) -> None:
    for command in ("train", "sft"):
        assert main([command]) == 2
        assert f"error: no config given: verl-core {command} CONFIG.yaml" in capsys.readouterr().err


def test_missing_files_and_folders_are_named_by_key_all_at_once(demo, tmp_path, capsys) -> None:
    errors = config_errors(
        capsys,
        *run_overrides(
            demo,
            tmp_path,
            **{
                "data.train_files": f"[{tmp_path / 'train.jsonl'}]",
                "data.val_files": f"[{demo.val}, {tmp_path / 'val.jsonl'}]",
                "actor.engine.model.path": "models/mymodel",
            },
        ),
    )
    assert "not found" in errors["data.train_files[0]"]
    assert "not found" in errors["data.val_files[1]"] and "data.val_files[0]" not in errors
    # A missing relative folder first, a hub id only perhaps: it names the working directory.
    assert errors["actor.engine.model.path"].startswith(
        "'models/mymodel' does not exist (relative paths are relative to"
    )


def test_a_model_folder_without_a_tokenizer(demo, tmp_path, capsys) -> None:
    model = model_copy(demo, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **{"actor.engine.model.path": model}))
    assert "has no tokenizer files" in errors["actor.engine.model.path"], errors


def test_a_tokenizer_larger_than_the_vocabulary(demo, tmp_path, capsys) -> None:
    model = model_copy(demo, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 10  # the demo's tokenizer has more tokens
    (model / "config.json").write_text(json.dumps(config))
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **{"actor.engine.model.path": model}))
    assert "vocabulary has 10" in errors["actor.engine.model.path"], errors


def test_truncated_weights(demo, tmp_path, capsys) -> None:
    model = model_copy(demo, tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **{"actor.engine.model.path": model}))
    assert "model.safetensors is" in errors["actor.engine.model.path"]
    assert "cut short" in errors["actor.engine.model.path"]


def test_a_checkpoint_dir_that_cannot_be_created_or_belongs_to_another_run(demo, tmp_path, capsys) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    errors = config_errors(
        capsys,
        *run_overrides(
            demo, tmp_path, **{"trainer.checkpoint_dir": blocker / "checkpoints", "trainer.save_freq": 1}
        ),
    )
    assert "is a file" in errors["trainer.checkpoint_dir"], errors

    # A folder nobody can create files in, root included (os.access says root may).
    errors = config_errors(
        capsys,
        *run_overrides(
            demo, tmp_path, **{"trainer.checkpoint_dir": "/proc/checkpoints", "trainer.save_freq": 1}
        ),
    )
    assert "'/proc/checkpoints' is not writable (/proc: " in errors["trainer.checkpoint_dir"], errors
    assert not Path("/proc/checkpoints").exists()

    sft_checkpoints = tmp_path / "sft_checkpoints" / "global_step_3"
    sft_checkpoints.mkdir(parents=True)
    (sft_checkpoints / "verl_checkpoint.json").write_text(
        json.dumps({"global_step": 3, "backend": "trainer", "world_size": 1})
    )
    (sft_checkpoints / "trainer_state.json").write_text(json.dumps({"trainer": "sft", "global_step": 3}))
    errors = config_errors(
        capsys, *run_overrides(demo, tmp_path, **{"trainer.checkpoint_dir": sft_checkpoints.parent})
    )
    assert "written by `verl-core sft`" in errors["trainer.checkpoint_dir"], errors


def test_a_logger_whose_package_is_missing(demo, tmp_path, capsys, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else real(name, *args)
    )
    get_registry(refresh=True)  # the registry sees what is installed when it is built
    try:
        errors = config_errors(
            capsys, *run_overrides(demo, tmp_path, **{"trainer.logger": "[console, wandb]"})
        )
    finally:
        monkeypatch.undo()
        get_registry(refresh=True)
    assert "metric sink 'wandb'" in errors["trainer.logger"]
    assert 'pip install "verl-core[wandb]"' in errors["trainer.logger"]


def test_an_unknown_logger_is_refused_with_the_close_match(demo, tmp_path, capsys) -> None:
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **{"trainer.logger": "[console, mlflw]"}))
    assert "Unknown metric sink 'mlflw'" in errors["trainer.logger"]
    assert "did you mean 'mlflow'?" in errors["trainer.logger"]


def test_the_checks_find_every_problem_of_one_config(demo, tmp_path) -> None:
    config = load_config(
        [],
        run_overrides(
            demo,
            tmp_path,
            **{"data.train_files": "[missing.jsonl]", "actor.engine.model.path": tmp_path / "nowhere"},
        ),
    )
    keys = [key for key, _ in check_run(config, trainer_kind(config))]
    assert keys == ["data.train_files[0]", "actor.engine.model.path"]


def test_train_reports_them_before_anything_starts(demo, tmp_path, capsys, monkeypatch) -> None:
    from verl_core.trainer import build

    monkeypatch.setattr(build, "build_roles", lambda *a, **k: pytest.fail("workers started"))
    overrides = run_overrides(demo, tmp_path, **{"data.val_files": "[missing.jsonl]"})
    assert main(["train", *overrides]) == 2
    assert "data.val_files[0]" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        from verl_core.trainer.rl import RLTrainer

        RLTrainer.from_config(load_config([], overrides))


# -- the engine backends the run uses, on the driver ---------------------------------------------------

VENDOR_PLUGIN = """
    import attrs
    from verl_core import EngineBackend, RolloutBackend, RolloutCapabilities, hookimpl

    @attrs.define
    class Options:
        heads_per_rank: int = 0

    @attrs.define
    class ServerOptions:
        max_model_len: int = 64

    def backend(name, engine):
        return EngineBackend(name=name, engine=engine, config="vendor_plugin:Options", api_version=1)

    @hookimpl
    def verl_engine_backends():
        return [
            backend("misspelt", "vendor_engines:VendorEngin"),
            backend("needs-apex", "vendor_apex_engine:Engine"),
            backend("checked", "vendor_engines:VendorEngine"),
            backend("raising", "vendor_engines:RaisingEngine"),
        ]

    def rollout(name, rollout_class, **fields):
        return RolloutBackend(
            name=name, rollout=rollout_class, config="vendor_plugin:ServerOptions", api_version=2,
            capabilities=RolloutCapabilities(), **fields
        )

    @hookimpl
    def verl_rollout_backends():
        return [
            rollout("served", "vendor_rollouts:ServedRollout"),
            rollout("raising-rollout", "vendor_rollouts:RaisingRollout"),
            rollout(
                "needs-server",
                "vendor_rollouts:ServedRollout",
                requires=("vendor_inference_server",),
                install='pip install "vendor-dist[server]"',
            ),
        ]
"""
VENDOR_ENGINES = """
    from verl_core.engine import BaseEngine
    from vendor_plugin import Options

    class VendorEngine(BaseEngine):
        options_class = Options

        @classmethod
        def check_before_start(cls, config, *, role, model_config, world_size, config_path):
            heads = model_config["num_attention_heads"]
            wanted = config.options.heads_per_rank
            if wanted and heads != wanted * world_size:
                return [(f"{config_path}.{config.backend}.heads_per_rank", f"{heads} heads, {world_size} ranks, {role}")]
            return []

    class RaisingEngine(VendorEngine):
        @classmethod
        def check_before_start(cls, config, **_):
            return {}["a key the plugin's author expected"]
"""
VENDOR_ROLLOUTS = """
    from verl_core.rollout import HFRollout
    from vendor_plugin import ServerOptions

    class ServedRollout(HFRollout):
        options_class = ServerOptions

        @classmethod
        def check_before_start(cls, config, *, model, model_config, world_size, batch_size, config_path):
            longest = config.prompt_length + config.response_length
            problems = []
            if config.options.max_model_len < longest:
                problems.append((f"{config_path}.served.max_model_len", f"{longest} tokens, {model.dtype}"))
            sequences = batch_size * config.n // world_size
            if sequences > 8:
                problems.append((f"{config_path}.n", f"{sequences} sequences per rank, {model_config['num_attention_heads']} heads"))
            return problems

    class RaisingRollout(ServedRollout):
        @classmethod
        def check_before_start(cls, config, **_):
            return {}["a key the plugin's author expected"]
"""


@pytest.fixture
def vendor(tmp_path):
    """A vendor's distribution whose engine backends have the mistakes a plugin author makes."""
    from fixtures.fake_dist import fake_distributions

    from verl_core.plugins import get_registry

    with fake_distributions(tmp_path) as dists:
        modules = {
            "vendor_engines": VENDOR_ENGINES,
            "vendor_apex_engine": "import apex_kernels\n",
            "vendor_rollouts": VENDOR_ROLLOUTS,
        }
        dists.add("vendor-dist", "0.3", {"vendor": VENDOR_PLUGIN}, modules=modules)
        get_registry(refresh=True)
        yield dists
    get_registry(refresh=True)


def test_an_engine_that_does_not_import_is_refused_at_its_backend_key_before_start(
    demo, vendor, tmp_path, capsys, monkeypatch
) -> None:
    """On main the import string was first imported by the ranks after start-up: `config` passed."""
    import sys

    from verl_core.trainer import build

    assert main(["plugins"]) == 0  # listed without importing any engine
    assert "vendor_engines" not in sys.modules and "vendor_apex_engine" not in sys.modules
    capsys.readouterr()
    monkeypatch.setattr(build, "build_roles", lambda *a, **k: pytest.fail("workers started"))
    for backend, cause in [
        ("misspelt", "AttributeError: module 'vendor_engines' has no attribute 'VendorEngin'"),
        ("needs-apex", "ModuleNotFoundError: No module named 'apex_kernels'"),
    ]:
        overrides = run_overrides(demo, tmp_path, backend=backend)
        errors = config_errors(capsys, *overrides)
        assert list(errors) == ["actor.engine.backend"], errors
        message = errors["actor.engine.backend"]
        assert message.startswith(
            f"engine backend '{backend}' from plugin 'vendor' (vendor-dist 0.3): its engine"
        )
        assert cause in message
        assert main(["train", *overrides]) == 2
        assert f"actor.engine.backend: engine backend '{backend}'" in capsys.readouterr().err


def test_a_plugin_checks_its_options_against_the_model_and_the_world_before_start(
    demo, vendor, tmp_path, capsys
) -> None:
    """BaseEngine.check_before_start: the model's config.json (the demo's: 4 attention heads) and
    trainer.world_size, on the driver; a check that raises names the plugin instead of a traceback."""
    ray = {"trainer.workers": "ray", "trainer.world_size": 3, "actor.engine.checked.heads_per_rank": 2}
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, backend="checked", **ray))
    assert errors == {"actor.engine.checked.heads_per_rank": "4 heads, 3 ranks, lm"}
    fits = {**ray, "trainer.world_size": 2}
    assert main(["config", *run_overrides(demo, tmp_path, backend="checked", **fits)]) == 0
    capsys.readouterr()
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, backend="raising"))
    assert errors["actor.engine.backend"] == (
        "engine backend 'raising' from plugin 'vendor' (vendor-dist 0.3): RaisingEngine.check_before_start "
        'raised KeyError: "a key the plugin\'s author expected"; fix or upgrade the plugin'
    )


def test_a_rollout_plugin_checks_its_options_against_the_model_and_the_batch_before_start(
    demo, vendor, tmp_path, capsys
) -> None:
    """BaseRollout.check_before_start: prompt plus response against the backend's own limit, the
    sequences a rank generates at once (4 prompts x 4 responses over 1 or 2 ranks), on the driver."""
    served = {"rollout.backend": "served", "rollout.served.max_model_len": 16}
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **served))
    assert errors == {
        "rollout.served.max_model_len": "22 tokens, float32",
        "rollout.n": "16 sequences per rank, 4 heads",
    }
    fits = {**served, "rollout.served.max_model_len": 22, "trainer.workers": "ray", "trainer.world_size": 2}
    assert main(["config", *run_overrides(demo, tmp_path, **fits)]) == 0
    capsys.readouterr()
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **{"rollout.backend": "raising-rollout"}))
    assert errors == {
        "rollout.backend": "rollout backend 'raising-rollout' from plugin 'vendor' (vendor-dist 0.3): "
        'RaisingRollout.check_before_start raised KeyError: "a key the plugin\'s author expected"; fix or '
        "upgrade the plugin"
    }


def test_a_rollout_whose_required_package_is_missing_is_unavailable_with_its_install_command(
    demo, vendor, tmp_path, capsys
) -> None:
    """A backend's ``requires`` (vLLM ships per device, so its plugin cannot depend on it): listed
    unavailable with the command, and refused at rollout.backend before anything starts."""
    from verl_core.plugins import get_registry

    expected = (
        "rollout backend 'needs-server' from plugin 'vendor' (vendor-dist 0.3) needs the module "
        "'vendor_inference_server', which is not installed. Fix: pip install \"vendor-dist[server]\""
    )
    assert main(["plugins", "--all"]) == 0
    listing = capsys.readouterr().out
    assert "unavailable" in listing and expected in listing, listing
    errors = config_errors(capsys, *run_overrides(demo, tmp_path, **{"rollout.backend": "needs-server"}))
    assert list(errors) == ["rollout.backend"] and errors["rollout.backend"].startswith(expected), errors
    assert main(["train", *run_overrides(demo, tmp_path, **{"rollout.backend": "needs-server"})]) == 2
    assert expected in capsys.readouterr().err
    vendor.add("vendor-server", modules={"vendor_inference_server": ""})  # installed: usable now
    get_registry(refresh=True)
    usable = {"rollout.backend": "needs-server", "trainer.workers": "ray", "trainer.world_size": 2}
    assert main(["config", *run_overrides(demo, tmp_path, **usable)]) == 0
