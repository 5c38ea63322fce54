"""Every shipped example config loads and builds its engines: an example that ``verl-core config``
accepts is one that runs. The model path is pointed at a tiny model made here (no hub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.config import load_config
from verl_core.engine import build_engine
from verl_core.testing import save_tiny_models

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("tiny"))


def test_there_are_examples() -> None:
    assert EXAMPLES, "examples/ holds no *.yaml"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_builds_and_initialises_its_engines(example: Path, tiny) -> None:
    overrides = [f"actor.engine.model.path={tiny.lm}", "actor.engine.device=cpu"]
    config = load_config([example], overrides)
    engines = {"actor.engine": ("lm", config.actor.engine)}
    if config.uses_kl:
        engines["ref.engine"] = ("lm", config.ref_engine)
    if config.critic.enable:
        critic = load_config([example], [*overrides, f"critic.engine.model.path={tiny.lm}"]).critic.engine
        engines["critic.engine"] = ("value", critic)
    for path, (role, engine_config) in engines.items():
        engine = build_engine(engine_config, role, config_path=path)
        engine.initialize()  # the optimiser, the schedule (total_steps from the run length), the model
        assert engine.get_lr() > 0, path
