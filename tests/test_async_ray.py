"""Asynchronous training under Ray: a rollout replica as a Ray actor of its own, the weights through
Ray's object store, a placement the cluster cannot hold refused before anything starts, and a replica
that dies named in the error that ends the run."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
import torch
from fixtures.demo import run_overrides

from verl_core.config import load_config
from verl_core.errors import ConfigError
from verl_core.trainer import checkpoints
from verl_core.trainer.rl import RLTrainer
from verl_core.workers.group import WorkerError

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)

ONE_STEP_OFF = {
    "trainer.workers": "ray",
    "rollout.placement": "separate",
    "rollout.replica_resources": "{CPU: 1}",
    "async_training.mode": "one_step_off",
}


def test_one_step_off_with_a_replica_under_ray_trains_and_a_dead_replica_ends_the_run_naming_it(
    demo, tmp_path, ray_cluster
) -> None:
    overrides = run_overrides(
        demo,
        tmp_path,
        **ONE_STEP_OFF
        | {"trainer.total_training_steps": 4, "trainer.save_freq": 2, "trainer.worker_timeout_s": 10},
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    ((pid, _),) = trainer.replicas.groups[0].processes
    assert pid != os.getpid()  # a process of its own
    train_step = trainer.train_step

    def until_step_3(step):
        if step == 3:  # batch 3 is generated already (from the checkpoint's weights), batch 4 is not
            os.kill(pid, signal.SIGKILL)
        return train_step(step)

    trainer.train_step = until_step_3
    try:
        with pytest.raises(
            WorkerError, match=r"rollout replica 0 rank 0's process \(pid \d+ on [\d.]+\) died"
        ):
            trainer.fit()
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Batch 3 may have been generated before the kill; batch 4 cannot be, whatever the timing.
    assert [line["step"] for line in lines][:2] == [1, 2] and len(lines) in (2, 3)
    # Batch 2 comes from the weights before step 1 (one step off).
    assert [line["async/staleness/max"] for line in lines][:2] == [0, 1]
    assert [step for step, _ in checkpoints.complete_checkpoints(tmp_path / "checkpoints")] == [2]

    resumed = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        resumed.fit()
    finally:
        resumed.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    # Batch 3 comes from the checkpoint's weights, batch 4 one step off them.
    assert [line["async/staleness/max"] for line in lines] == [0, 1, 0, 1]


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
    with contextlib.suppress(Exception):
        assert not [a for a in ray_cluster.util.list_named_actors()]
