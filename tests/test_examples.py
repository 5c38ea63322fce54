"""Every shipped example config loads and builds its engines: an example that ``verl-core config``
accepts is one that runs. The model path is pointed at a tiny model made here (no hub). The RL
examples on the demo task train two steps each (in process, on the demo's tiny model and data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.config import load_config
from verl_core.engine import build_engine
from verl_core.testing import save_tiny_models
from verl_core.trainer.loop import with_run_length
from verl_core.trainer.rl import updates_per_step

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny"))


def test_there_are_examples() -> None:
    assert EXAMPLES, "examples/ holds no *.yaml"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_builds_and_initialises_its_engines(example: Path, tiny) -> None:
    overrides = [f"actor.engine.model.path={tiny.lm}", "actor.engine.device=cpu"]
    teachers = load_config([example], overrides).distillation.teachers
    overrides += [f"distillation.teachers.{name}.engine.model.path={tiny.lm}" for name in teachers]
    loaded = load_config([example], overrides)
    config, _ = with_run_length(loaded, 64, updates_per_step(loaded))  # as the trainer fills it
    engines = {"actor.engine": ("lm", config.actor.engine)}
    if config.uses_kl:
        engines["ref.engine"] = ("lm", config.ref_engine)
    if config.critic.enable:
        critic = load_config([example], [*overrides, f"critic.engine.model.path={tiny.lm}"])
        critic = with_run_length(critic, 64, updates_per_step(critic))[0].critic.engine
        engines["critic.engine"] = ("value", critic)
    for name, teacher in config.distillation.teachers.items():
        engines[f"distillation.teachers.{name}.engine"] = ("lm", teacher.engine)
    for path, (role, engine_config) in engines.items():
        engine = build_engine(engine_config, role, config_path=path)
        engine.initialize()  # the optimiser, the schedule (total_steps from the run length), the model
        assert engine.get_lr() > 0, path


DEMO_EXAMPLES = [path for path in EXAMPLES if "runs/demo/model" in path.read_text()]


def test_the_recipes_are_all_there() -> None:
    assert {path.stem for path in DEMO_EXAMPLES} >= {"grpo", "ppo_gae", "rloo", "reinforce_pp", "dapo"}


@pytest.mark.parametrize("example", DEMO_EXAMPLES, ids=lambda path: path.name)
def test_example_trains_two_steps(example: Path, demo, tmp_path) -> None:
    from verl_core.trainer.rl import RLTrainer

    model = str(demo.model)
    overrides = [
        f"actor.engine.model.path={model}",
        f"data.train_files=[{demo.train}]",
        f"data.val_files=[{demo.val}]",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.save_freq=0",
        "trainer.workers=in_process",
        "trainer.logger=[]",
        "trainer.save_hf_model=false",
        f"trainer.run_dir={tmp_path / 'run'}",
        f"trainer.checkpoint_dir={tmp_path / 'checkpoints'}",
    ]
    config = load_config([example], overrides)
    if config.critic.enable:
        config = load_config([example], [*overrides, f"critic.engine.model.path={model}"])
    trainer = RLTrainer.from_config(config, show_progress=False)
    final = trainer.fit()
    assert final["actor/grad_norm"] == final["actor/grad_norm"] and final["actor/grad_norm"] > 0
    assert "val/score/mean" in final
