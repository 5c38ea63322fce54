"""The RL trainer under Ray: the actor's worker group is two Ray actors forming a gloo group, with the
fsdp backend sharded over them; an unreachable cluster address is an error within seconds."""

from __future__ import annotations

import json
import time

import pytest
import torch
from fixtures.demo import build_small_demo, run_overrides

from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer
from verl_core.workers.group import WorkerError

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_small_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def ray_session():
    from verl_core.workers.ray_group import ensure_ray

    ray = ensure_ray(None)
    yield ray
    ray.shutdown()


def test_grpo_on_two_fsdp_ranks_under_ray(demo, tmp_path, ray_session) -> None:
    overrides = run_overrides(
        demo,
        tmp_path,
        backend="fsdp",
        **{"trainer.workers": "ray", "trainer.world_size": 2, "trainer.test_freq": 2, "trainer.save_freq": 2},
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        assert trainer.actor.dp_size == 2
        final = trainer.fit()
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert final["actor/grad_norm"] > 0 and 0.0 <= final["reward/mean"] <= 1.0
    assert (tmp_path / "checkpoints" / "global_step_2" / "actor").is_dir()


def test_an_unreachable_ray_address_is_an_error_within_seconds(demo, tmp_path) -> None:
    from verl_core.workers.ray_group import RayWorkerGroup

    started = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"trainer\.ray_address='127\.0\.0\.1:1': no Ray cluster answers there"
    ):
        RayWorkerGroup("actor", lambda: None, world_size=1, address="127.0.0.1:1")
    assert time.monotonic() - started < 15
