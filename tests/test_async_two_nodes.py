"""Asynchronous training on two Ray nodes made on this machine (``ray.cluster_utils.Cluster``, on
loopback): the actor on one node, the rollout replica on the other; the replica's node lost after a
checkpoint ends the run naming that node, the checkpoint intact, and the run started again resumes; a
node that does not see the driver's checkpoint folder is refused before training
(``tests/fixtures/two_nodes.py`` runs it, in a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.processes import stop_processes_mentioning

pytestmark = pytest.mark.distributed


def test_two_nodes_lose_the_rollout_node_resume_and_refuse_an_unshared_checkpoint_folder(
    demo, tmp_path
) -> None:
    result_file = tmp_path / "result.json"
    script = Path(__file__).parent / "fixtures" / "two_nodes.py"
    command = [sys.executable, script, result_file, tmp_path / "work", demo.model, demo.train, demo.val]
    # Every process of the cluster inherits the marker: the test stops them, whatever happened.
    marker = f"VERL_TWO_NODES_TEST={tmp_path}"
    environment = os.environ | dict([marker.split("=", 1)])
    try:
        completed = subprocess.run(
            [str(part) for part in command], capture_output=True, text=True, timeout=300, env=environment
        )
    finally:
        stop_processes_mentioning(marker)
    assert result_file.is_file(), completed.stderr[-4000:]
    result = json.loads(result_file.read_text())
    assert result["actor_node_is_head"] and result["replica_on_rollout_node"], result
    assert "rollout replica 0 rank 0's process" in result["first_run"], result["first_run"]
    assert (
        "is gone from the cluster" in result["first_run"]
        and "last checkpoint is intact" in result["first_run"]
    )
    assert result["checkpoints"] == ["global_step_2", "global_step_4"]
    # The run started again resumes after step 4: batch 5 from the checkpoint's weights, 6 one step off.
    assert result["steps"][-2:] == [5, 6] and result["staleness"][-2:] == [0, 1]
    unshared = result["unshared"]
    if "skipped" in unshared:
        pytest.skip(unshared["skipped"])
    ((key, message),) = unshared["errors"]
    assert key == "trainer.checkpoint_dir"
    assert "is not the folder the driver sees on Ray node" in message and "actor rank 0" in message
