"""Every path of a run config is made absolute on the driver before the config reaches a worker, which
may run in another folder (verl_core.config.paths); the driver's own config stays as written."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import attrs

from verl_core.config import EngineConfig, ModelConfig, RunConfig
from verl_core.config.paths import PATH_KEYS, absolute_path, absolute_paths
from verl_core.config.run import (
    ActorConfig,
    CriticConfig,
    DataConfig,
    DistillationConfig,
    RefConfig,
    RewardConfig,
    TeacherConfig,
    TrainerConfig,
)

#: Field names that hold a path; a field named so that is not in PATH_KEYS fails the coverage test.
LOOKS_LIKE_A_PATH = re.compile(r"(^|_)(path|paths|dir|dirs|file|files|folder)$")


def engine(path: str) -> EngineConfig:
    return EngineConfig(backend="ddp", model=ModelConfig(path=path))


def relative_config() -> RunConfig:
    return RunConfig(
        actor=ActorConfig(engine=engine("runs/demo/model")),
        ref=RefConfig(engine=engine("../ref")),
        critic=CriticConfig(enable=True, engine=engine("critic")),
        reward=RewardConfig(function="rewards/mine.py:score"),
        data=DataConfig(train_files=["data/train.jsonl", "/abs/train.jsonl"], val_files=["data/val.jsonl"]),
        trainer=TrainerConfig(
            checkpoint_dir="ckpt", run_dir="./runs/x", resume_mode="resume_path", resume_from_path="ckpt/s1"
        ),
        distillation=DistillationConfig(teachers={"big": TeacherConfig(engine=engine("teachers/big"))}),
    )


def test_every_path_is_made_absolute_against_the_base_and_the_original_is_untouched(tmp_path) -> None:
    config = relative_config()
    resolved = absolute_paths(config, base=tmp_path / "work")
    work = tmp_path / "work"
    assert resolved.actor.engine.model.path == str(work / "runs/demo/model")
    assert resolved.ref.engine.model.path == str(tmp_path / "ref")  # normalised
    assert resolved.critic.engine.model.path == str(work / "critic")
    assert resolved.distillation.teachers["big"].engine.model.path == str(work / "teachers/big")
    assert resolved.reward.function == f"{work / 'rewards/mine.py'}:score"
    assert resolved.data.train_files == [str(work / "data/train.jsonl"), "/abs/train.jsonl"]
    assert resolved.data.val_files == [str(work / "data/val.jsonl")]
    assert resolved.trainer.checkpoint_dir == str(work / "ckpt")
    assert resolved.trainer.run_dir == str(work / "runs/x")
    assert resolved.trainer.resume_from_path == str(work / "ckpt/s1")
    assert config == relative_config()  # the driver keeps what the user wrote
    assert absolute_paths(resolved, base="/elsewhere") == resolved  # absolute paths stay


def test_names_none_and_the_working_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = RunConfig(actor=ActorConfig(engine=engine("model")))  # no ref, critic or resume path
    resolved = absolute_paths(config)
    assert resolved.actor.engine.model.path == str(tmp_path / "model")
    assert resolved.ref.engine is None and resolved.critic.engine is None
    assert resolved.trainer.resume_from_path is None
    assert resolved.reward.function == "exact_match"  # a registered name, not a file
    assert absolute_path("a/../b") == str(tmp_path / "b")


def test_home_is_expanded_where_the_reader_expands_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = RunConfig(
        actor=ActorConfig(engine=engine("~/model")),
        reward=RewardConfig(function="~/r.py:score"),
        trainer=TrainerConfig(checkpoint_dir="~/ckpt"),
    )
    resolved = absolute_paths(config, base=tmp_path)
    assert resolved.actor.engine.model.path == str(tmp_path / "home" / "model")
    assert resolved.reward.function == f"{tmp_path / 'home' / 'r.py'}:score"
    assert resolved.trainer.checkpoint_dir == str(tmp_path / "~" / "ckpt")  # as the trainer itself reads it


def _fields(cls: type, prefix: str = ""):
    """Every field of a config class, dotted, descending into nested config classes."""
    for field in attrs.fields(cls):
        key = f"{prefix}{field.name}"
        nested = [t for t in getattr(field.type, "__args__", (field.type,)) if attrs.has(t)]
        if getattr(field.type, "__origin__", None) is dict:  # its values, as PATH_KEYS writes them
            key += "{}"
        if attrs.has(field.type) or nested:
            yield from _fields(nested[0] if nested else field.type, key + ".")
        else:
            yield key


def test_every_path_field_of_the_config_classes_is_listed() -> None:
    import typing

    # Resolve the string annotations (``from __future__ import annotations``) of every class on the way.
    for cls in (
        RunConfig,
        ActorConfig,
        RefConfig,
        CriticConfig,
        EngineConfig,
        TrainerConfig,
        DataConfig,
        DistillationConfig,
        TeacherConfig,
    ):
        attrs.resolve_types(cls, globalns=vars(__import__(cls.__module__, fromlist=["_"])))
    keys = {key.removesuffix("[]") for key in PATH_KEYS}
    path_fields = {key for key in _fields(RunConfig) if LOOKS_LIKE_A_PATH.search(key.rsplit(".", 1)[-1])}
    assert path_fields <= keys, f"path-like fields missing from PATH_KEYS: {sorted(path_fields - keys)}"
    # Not named like a path: a name or a file, and the tools file.
    assert keys - path_fields == {"reward.function", "rollout.agent.tools"}
    assert typing.get_type_hints(TrainerConfig)["checkpoint_dir"] is str


def test_the_config_a_worker_gets_is_absolute_and_travels(tmp_path, monkeypatch) -> None:
    from verl_core.trainer.build import WorkerMaker
    from verl_core.workers.ranks import ActorWorker

    monkeypatch.chdir(tmp_path)
    maker = pickle.loads(pickle.dumps(WorkerMaker(ActorWorker, relative_config(), registry=None)))
    assert maker.config == absolute_paths(relative_config(), base=tmp_path)
    assert Path(maker.config.trainer.run_dir).is_absolute() and os.path.isabs(
        maker.config.actor.engine.model.path
    )
