"""Asynchronous training under Ray: a placement the cluster cannot hold is refused before anything
starts. (tests/test_async_two_nodes.py trains with a replica on a node of its own, loses it, resumes.)"""

from __future__ import annotations

import pytest
import torch
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.errors import ConfigError
from verl_core.trainer.rl import RLTrainer

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)

ONE_STEP_OFF = {
    "trainer.workers": "ray",
    "rollout.placement": "separate",
    "rollout.replica_resources": "{CPU: 1}",
    "async_training.mode": "one_step_off",
}


def test_replicas_the_cluster_cannot_hold_are_refused_before_anything_starts(
    demo, tmp_path, ray_cluster
) -> None:
    cpus = ray_cluster.cluster_resources()["CPU"]
    overrides = run_overrides(
        demo, tmp_path, **ONE_STEP_OFF | {"rollout.replica_resources": f"{{CPU: {cpus + 1}}}"}
    )
    with pytest.raises(ConfigError) as error:
        RLTrainer.from_config(load_config([], overrides), show_progress=False)
    ((key, message),) = error.value.errors
    assert key == "rollout.replica_resources"
    assert f"rollout replica 0 rank 0 asks for {cpus + 1:g} CPU, more than any node" in message
    overrides = run_overrides(demo, tmp_path, **ONE_STEP_OFF | {"rollout.replicas": int(cpus) + 1})
    with pytest.raises(ConfigError) as error:
        RLTrainer.from_config(load_config([], overrides), show_progress=False)
    ((key, message),) = error.value.errors
    assert key == "rollout.replica_resources" and f"ask for {int(cpus) + 1} CPU together" in message
