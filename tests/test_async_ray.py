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


def test_a_replica_under_ray_serves_requests_together_as_its_rollout_does_and_its_death_is_named(
    demo, tmp_path, ray_cluster
) -> None:
    import asyncio
    import os
    import signal

    from verl_core.rollout import RolloutRequest, SamplingParams
    from verl_core.rollout.hf import HFRollout
    from verl_core.trainer.build import replica_specs, worker_groups
    from verl_core.workers.group import WorkerError
    from verl_core.workers.replicas import RolloutReplicas

    config = load_config([], run_overrides(demo, tmp_path, **ONE_STEP_OFF))
    replicas = RolloutReplicas(worker_groups(config, replica_specs(config)))  # a replica alone
    try:
        sampling = SamplingParams(max_new_tokens=6, eos_token_ids=(0,), pad_token_id=0, temperature=1.0)
        requests = [RolloutRequest((5 + i, 7, 9), sampling, seed=i) for i in range(4)]

        async def together(serve):
            return await asyncio.gather(
                *(serve(request, f"session {i}") for i, request in enumerate(requests))
            )

        responses = asyncio.run(together(replicas.generate_request))
        local = HFRollout(config.rollout_model, config.rollout.options)
        local.initialize()
        expected = asyncio.run(together(lambda request, session: local.generate_request(request)))
        assert [r.token_ids for r in responses] == [r.token_ids for r in expected]
        ((pid, _),) = replicas.groups[0].processes
        os.kill(pid, signal.SIGSTOP)  # stopped (hung): named once it has not answered for 4 s
        replicas.groups[0].liveness_timeout_s = 4
        with pytest.raises(
            WorkerError, match=r"rollout replica 0 rank 0 \(pid \d+ on [\d.]+\) has not answered"
        ):
            asyncio.run(together(replicas.generate_request))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(
            WorkerError, match=r"rollout replica 0 rank 0's process \(pid \d+ on [\d.]+\) died"
        ):
            asyncio.run(together(replicas.generate_request))
    finally:
        replicas.shutdown()
