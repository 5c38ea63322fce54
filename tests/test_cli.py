"""The ``verl-core`` command line: ``plugins`` (table, JSON, exit codes, light imports) and ``config``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fake_dist import backends_plugin, fake_distributions

import verl_core.config
import verl_core.plugins.registry
from verl_core import ENGINE_API_VERSION, __version__
from verl_core.cli import BACKEND_COLUMNS, main
from verl_core.errors import ConfigError
from verl_core.plugins import get_registry
from verl_core.plugins.switches import ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_TRACE

BROKEN = "raise ImportError('needs a library that is not installed')"
HEAVY_MODULES = ("torch", "cattrs", "yaml", "transformers", "megatron")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for variable in (ENV_BLOCK, ENV_DISABLE_AUTOLOAD, ENV_PLUGINS, ENV_TRACE):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """Fake distributions: two backends (one speaking another engine API), a broken and a blocked plugin."""
    with fake_distributions(tmp_path) as dists:
        dists.add("good-dist", "0.2", {"good": backends_plugin("gddp", "gfsdp2")})
        dists.add(
            "old-dist",
            "0.1",
            {"old": backends_plugin("gold", api_version=0, devices=("cpu",), roles=("lm",))},
        )
        dists.add("broken-dist", "1.0", {"broken": BROKEN})
        dists.add("blocked-dist", "1.0", {"blocked": BROKEN})
        monkeypatch.setenv(ENV_BLOCK, "blocked-dist")
        get_registry(refresh=True)
        yield dists
    monkeypatch.delenv(ENV_BLOCK)
    get_registry(refresh=True)  # forget the fake plugins


def run_json(capsys, *argv: str) -> object:
    assert main(["plugins", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_rows_one_per_backend_and_one_per_plugin_without_backends(installed, capsys):
    rows = [
        row for row in run_json(capsys) if row["plugin"] in ("verl_core", "good", "old", "broken", "blocked")
    ]
    assert all(list(row) == list(BACKEND_COLUMNS) for row in rows)
    empty = {"backend": None, "devices": [], "roles": [], "api_version": None}
    assert rows[0] == {
        "plugin": "verl_core",
        "distribution": "verl-core",
        "version": __version__,
        **empty,
    } | {
        "status": "ok",
        "error": None,
    }
    good = {"plugin": "good", "distribution": "good-dist", "version": "0.2", "devices": ["cpu", "cuda"]}
    good |= {"roles": ["lm", "value"], "api_version": ENGINE_API_VERSION, "status": "ok", "error": None}
    by_key = {(row["plugin"], row["backend"]): row for row in rows}
    assert by_key["good", "gddp"] == good | {"backend": "gddp"}
    assert by_key["good", "gfsdp2"] == good | {"backend": "gfsdp2"}
    old = by_key["old", "gold"]
    assert (old["devices"], old["roles"], old["api_version"], old["status"]) == (
        ["cpu"],
        ["lm"],
        0,
        "incompatible",
    )
    assert f"speaks engine API version {ENGINE_API_VERSION}" in old["error"]
    assert "Upgrade old-dist (pip install -U old-dist)" in old["error"]
    broken = by_key["broken", None]
    assert (broken["distribution"], broken["version"], broken["status"]) == ("broken-dist", "1.0", "broken")
    assert "ImportError: needs a library that is not installed" in broken["error"]
    blocked = by_key["blocked", None]
    assert (blocked["status"], blocked["error"]) == ("blocked", f"blocked by {ENV_BLOCK}")


def test_table_has_the_same_rows_with_empty_backend_cells(installed, capsys):
    assert main(["plugins"]) == 0
    # The table ends at the first blank line (what follows lists other kinds' problems: an installed
    # rollout backend whose package is missing, say).
    header, *lines = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert header.split() == [
        "plugin",
        "backend",
        "distribution",
        "version",
        "devices",
        "roles",
        "api_version",
        "status",
        "error",
    ]
    backend_column = slice(header.index("backend"), header.index("distribution"))
    lines_by_plugin: dict[str, list[str]] = {}
    for line in lines:
        lines_by_plugin.setdefault(line.split()[0], []).append(line)
    assert [line[backend_column].strip() for line in lines_by_plugin["good"]] == ["gddp", "gfsdp2"]
    assert lines_by_plugin["good"][0].split() == [
        "good",
        "gddp",
        "good-dist",
        "0.2",
        "cpu,cuda",
        "lm,value",
        str(ENGINE_API_VERSION),
        "ok",
    ]
    without_backend = {
        "verl_core": ["verl-core", __version__, "ok"],
        "broken": ["broken-dist", "1.0", "broken"],
        "blocked": ["blocked-dist", "1.0", "blocked"],
    }
    for plugin, cells in without_backend.items():
        (line,) = lines_by_plugin[plugin]
        assert line[backend_column].strip() == ""
        assert line.split()[1:4] == cells
    assert "ImportError: needs a library that is not installed" in lines_by_plugin["broken"][0]


def test_all_lists_every_registry(installed, capsys):
    document = run_json(capsys, "--all")
    registry = get_registry()
    assert list(document) == registry.kinds
    for kind in registry.kinds[1:]:
        assert [row["name"] for row in document[kind]] == [entry.name for entry in registry.entries(kind)]
    assert main(["plugins", "--all"]) == 0
    assert "\nadvantage_estimators:\nname" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "code"),
    [([], 2), (["plugins", "--bogus"], 2), (["nonsense"], 2), (["--version"], 0), (["plugins", "--help"], 0)],
)
def test_exit_codes(argv, code, capsys):
    assert main(argv) == code


def test_listing_in_a_fresh_process_imports_nothing_heavy(tmp_path):
    with fake_distributions(tmp_path) as dists:
        dists.add("light-dist", "0.5", {"light": backends_plugin("light")})
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(dists.site), os.environ.get("PYTHONPATH", "")]),
        }
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "verl_core", "plugins", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=True,
        )
    assert "light" in [row["backend"] for row in json.loads(result.stdout)]
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "verl_core.plugins" in imported  # the trace is real
    heavy = sorted(module for module in imported if module.split(".")[0] in HEAVY_MODULES)
    assert heavy == [], f"`verl-core plugins` imported {heavy}"


# -- verl-core config ----------------------------------------------------------------------------


@pytest.fixture
def fake_loader(monkeypatch):
    """Stand-ins for the config loader, recording how the command calls it."""
    calls = []

    def load_config(paths, overrides, rl_rules=True):
        calls.append((list(paths), list(overrides)))
        if any(o.startswith("bad") for o in overrides):
            raise ConfigError(
                [("actor.engine.backend", "unknown engine backend 'bad'"), ("data.x", "unknown key")]
            )
        return {"paths": paths, "overrides": overrides}

    monkeypatch.setattr(verl_core.config, "load_config", load_config, raising=False)
    monkeypatch.setattr(verl_core.config, "dump_yaml", lambda cfg: f"resolved: {cfg}\n", raising=False)
    return calls


def test_config_passes_files_and_overrides_and_prints_yaml(fake_loader, capsys):
    assert (
        main(
            ["config", "--for", "train", "--no-file-checks", "a.yaml", "b.yaml", "trainer.seed=3"]
            + ["-o", "rollout.n=4", "--override", "x.y=z"]
        )
        == 0
    )
    assert fake_loader == [(["a.yaml", "b.yaml"], ["trainer.seed=3", "rollout.n=4", "x.y=z"])]
    assert capsys.readouterr().out.startswith("resolved: {'paths': ['a.yaml', 'b.yaml']")


def test_config_errors_go_to_stderr_with_exit_2(fake_loader, capsys):
    assert main(["config", "run.yaml", "-o", "bad=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "2 error(s) in the configuration" in captured.err
    assert "  actor.engine.backend: unknown engine backend 'bad'" in captured.err
    assert "  data.x: unknown key" in captured.err


OPTIONS_PLUGIN = """
    import attrs
    from verl_core import EngineBackend, hookimpl

    @attrs.define
    class Options:
        bucket_mb: int = 25

    @hookimpl
    def verl_engine_backends():
        return [EngineBackend(name="fakeeng", engine="fakeeng_plugin:Options", config="fakeeng_plugin:Options", api_version=1)]
"""


@pytest.fixture
def run_yaml(tmp_path):
    """A run config selecting a backend of a fake distribution, with the real config loader."""
    with fake_distributions(tmp_path) as dists:
        dists.add("fakeeng-dist", "0.1", {"fakeeng": OPTIONS_PLUGIN})
        get_registry(refresh=True)
        path = tmp_path / "run.yaml"
        path.write_text(
            "actor:\n  engine:\n    backend: fakeeng\n    fakeeng: {bucket_mb: 50}\n    model: {path: /models/tiny}\n"
            "algorithm: {adv_estimator: grpo}\n"
        )
        yield path
    get_registry(refresh=True)


def test_config_with_the_real_loader_prints_the_resolved_yaml(run_yaml, capsys):
    import yaml

    assert main(["config", "--no-file-checks", str(run_yaml), "trainer.seed=7", "-o", "rollout.n=4"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["actor"]["engine"]["fakeeng"] == {"bucket_mb": 50}
    assert (resolved["trainer"]["seed"], resolved["rollout"]["n"]) == (7, 4)
    assert resolved["actor"]["engine"]["optim"]["lr"] == 1e-6  # defaults filled in


def test_config_with_the_real_loader_reports_every_error(run_yaml, capsys):
    assert main(["config", str(run_yaml), "actor.engine.fakeeng.bucket_mbb=3", "-o", "rollout.n=0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"2 error(s) in the configuration in {run_yaml}:" in captured.err
    assert "  actor.engine.fakeeng.bucket_mbb: unknown key (did you mean 'bucket_mb'?)" in captured.err
    assert "  rollout.n: " in captured.err


CLASHING_PLUGIN = """
    from verl_core import PolicyLoss, hookimpl

    @hookimpl
    def verl_policy_losses():
        return [PolicyLoss(name="vanilla", function="fake_engines:Engine")]
"""


def test_a_plugin_clashing_with_a_builtin_does_not_look_fine_in_the_default_listing(tmp_path, capsys):
    with fake_distributions(tmp_path) as dists:
        dists.add("clash-dist", "0.4", {"clash": CLASHING_PLUGIN})
        get_registry(refresh=True)
        try:
            (row,) = [row for row in run_json(capsys) if row["plugin"] == "clash"]
            assert main(["plugins"]) == 0
            table = capsys.readouterr().out
        finally:
            get_registry(refresh=True)
    assert row["status"] == "conflict"
    assert "policy_losses 'vanilla': policy loss 'vanilla' is provided by plugin 'verl_core'" in row["error"]
    assert "Problems with what plugins provide besides engine backends" in table
    assert "policy_losses 'vanilla' from plugin 'clash' (clash-dist 0.4): conflict:" in table


def test_an_invalid_switch_fails_the_listing_with_exit_2(monkeypatch, capsys):
    monkeypatch.setenv(ENV_TRACE, "sure")
    monkeypatch.setattr(verl_core.plugins.registry, "_registry", None)  # as in a fresh process
    try:
        assert main(["plugins"]) == 2
    finally:
        monkeypatch.delenv(ENV_TRACE)
        get_registry(refresh=True)
    assert f"error: {ENV_TRACE}='sure' is not a boolean" in capsys.readouterr().err


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny_ddp.yaml"


@pytest.fixture
def installed_plugins():
    """The process-wide registry rediscovered: what is installed, without fake distributions that
    earlier tests may have left in it."""
    yield get_registry(refresh=True)
    get_registry(refresh=True)


def test_config_names_a_misspelt_estimator_and_the_close_match(installed_plugins, capsys):
    assert main(["config", str(EXAMPLE), "algorithm.adv_estimator=gpro"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = [line for line in captured.err.splitlines() if line.startswith("  algorithm.adv_estimator: ")]
    assert "Unknown advantage estimator 'gpro'" in line and "(did you mean 'grpo'?)" in line
    assert line.endswith("(from override 'algorithm.adv_estimator=gpro')")


def test_config_of_the_example_leaves_the_decay_length_to_the_trainer(installed_plugins, capsys):
    import yaml

    if "ddp" not in installed_plugins.names("engine_backends"):
        pytest.skip("the ddp backend (plugins/verl_ddp) is not installed")
    assert main(["config", "--no-file-checks", str(EXAMPLE)]) == 0
    captured = capsys.readouterr()
    # no errors, no warnings: only the line saying what it was checked for
    # (its data is not there to tell SFT from RL: --no-file-checks is for another machine's config)
    assert captured.err.splitlines() == [
        "verl-core: checked as a config for `verl-core train`: data.train_files[0] cannot be read to tell an "
        "SFT config from an RL one (--for sft checks it for `verl-core sft`)"
    ]
    resolved = yaml.safe_load(captured.out)
    # 0: the run's length in optimiser steps, which the trainer fills in once it knows the dataset.
    assert resolved["actor"]["engine"]["optim"]["total_steps"] == 0
    assert resolved["trainer"]["total_training_steps"] == 20


def test_config_prints_a_warning_per_ignored_option_and_exits_0(run_yaml, capsys):
    import yaml

    ref = "ref.engine={backend: fakeeng, model: {path: /models/ref}}"
    assert (
        main(
            [
                "config",
                "--no-file-checks",
                str(run_yaml),
                "rollout.n=2",
                "trainer.resume_from_path=/ckpt",
                "-o",
                ref,
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.err.splitlines()[:-1] == [
        "warning: trainer.resume_from_path: ignored: resume_mode is 'auto'; set trainer.resume_mode=resume_path "
        "to resume from this checkpoint, or remove it (from override 'trainer.resume_from_path=/ckpt')",
        "warning: ref.engine: ignored: no KL term is on (actor.policy_loss.use_kl_loss and "
        "algorithm.use_kl_in_reward are false), so no reference policy runs; turn one on, or remove "
        f"ref.engine (from override '{ref}')",
    ]
    assert yaml.safe_load(captured.out)["trainer"]["resume_from_path"] == "/ckpt"  # still printed


def test_config_says_an_item_that_looks_like_a_key_is_an_override_missing_equals(run_yaml, capsys):
    assert main(["config", str(run_yaml), "actor.engine.optim.lr", "rollout.n"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "2 error(s) in the configuration in overrides:",
        "  'actor.engine.optim.lr' is not a file and looks like an override missing '=': write key=value "
        "(actor.engine.optim.lr=VALUE)",
        "  'rollout.n' is not a file and looks like an override missing '=': write key=value (rollout.n=VALUE)",
    ]


def test_config_reads_a_file_named_like_a_key_and_reports_a_missing_yaml_file(
    run_yaml, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rollout.n").write_text("rollout: {n: 6}\n")
    assert main(["config", "--no-file-checks", str(run_yaml), "rollout.n"]) == 0  # an existing file is a file
    assert "  n: 6\n" in capsys.readouterr().out
    assert main(["config", "trainer.yaml"]) == 2
    assert (
        "trainer.yaml:\n  cannot read the config file: No such file or directory" in capsys.readouterr().err
    )


def test_config_names_a_file_that_is_not_utf_8(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"data: {prompt_key: \xff}\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"1 error(s) in the configuration in {path}:" in err
    assert "not UTF-8 text: byte 0xff at offset 19" in err and "save the file as UTF-8" in err


def test_a_block_list_typo_is_a_warning_line_in_the_listing(monkeypatch, capsys):
    monkeypatch.setenv(ENV_BLOCK, "ddpp")
    monkeypatch.setattr(verl_core.plugins.registry, "_registry", None)  # as in a fresh process
    try:
        assert main(["plugins"]) == 0
    finally:
        monkeypatch.delenv(ENV_BLOCK)
        get_registry(refresh=True)
    assert f"warning: {ENV_BLOCK} names 'ddpp'" in capsys.readouterr().err


def test_the_stop_line_comes_as_the_signal_arrives_not_when_the_main_thread_gets_to_it(capsys):
    """A thread woken by the signal prints it: a main thread inside a call that returns to Python only
    later (a wait on Ray's ranks) would be killed first under ``nox``, which kills 0.5 s after Ctrl-C."""
    import signal
    import threading

    from verl_core.cli import EXIT_INTERRUPTED, _StopSignals

    described, seen = [], threading.Event()

    def describe(code: int) -> str:
        described.append((code, threading.current_thread() is threading.main_thread()))
        seen.set()
        return "interrupted here"

    with _StopSignals(describe) as stop:
        with pytest.raises(KeyboardInterrupt):  # the main thread's own handler, whenever it runs
            signal.raise_signal(signal.SIGINT)
        assert seen.wait(timeout=60), "no stop line"
        stop.say_stopped()  # the main thread's turn: the line is out already
    assert described == [(EXIT_INTERRUPTED, False)] and stop.code == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "verl-core: interrupted here\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and signal.set_wakeup_fd(-1) == -1


def _serve_yaml(tmp_path: Path, **changes: object) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    values = {
        "base_models": {"tiny": str(model)},
        "state_dir": str(tmp_path / "state"),
        "engine": {"backend": "ddp", "device": "cpu"},
        "token": "tml-test",
    } | changes
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps(values))
    return path


def test_serve_checks_its_config_before_starting(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("VERL_CORE_SERVE_TOKEN", raising=False)
    config = _serve_yaml(tmp_path, token="", base_models={"tiny": str(tmp_path / "missing")})
    assert main(["serve", str(config), "port=-1", "engine.backend=dpp"]) == 2
    err = capsys.readouterr().err
    assert "token: required: set token (or the environment variable VERL_CORE_SERVE_TOKEN)" in err
    assert f"base_models.tiny: '{tmp_path / 'missing'}' is not a Hugging Face model folder" in err
    assert "port: must be" in err and "engine.backend" in err and "ddp" in err
    assert main(["serve", str(_serve_yaml(tmp_path, token="secret"))]) == 2
    assert "token: must start with 'tml-'" in capsys.readouterr().err
    assert main(["serve"]) == 2
    assert "no config given" in capsys.readouterr().err


def test_serve_config_takes_the_token_from_the_environment_and_defaults_the_engine_model(
    tmp_path, monkeypatch
):
    from verl_core.config import load_serve_config

    monkeypatch.setenv("VERL_CORE_SERVE_TOKEN", "tml-from-env")
    config = load_serve_config([_serve_yaml(tmp_path, token="")])
    assert config.resolved_token() == "tml-from-env"
    assert (config.host, config.port) == ("127.0.0.1", 8000)  # loopback unless told otherwise
    assert config.engine.model.path == str(tmp_path / "model")


def test_the_serve_example_loads(tmp_path, monkeypatch):
    """examples/serve/serve.yaml is a valid config once its demo model exists (here a stand-in folder)."""
    from verl_core.config import load_serve_config

    monkeypatch.setenv("VERL_CORE_SERVE_TOKEN", "tml-change-me")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    example = Path(__file__).parents[1] / "examples" / "serve" / "serve.yaml"
    config = load_serve_config([example], [f"base_models={{verl-demo/tiny: {model}}}"])
    assert (config.host, config.port, list(config.base_models)) == ("127.0.0.1", 8000, ["verl-demo/tiny"])
    assert config.engine.backend == "ddp" and config.engine.model.path == str(model)
