"""Whether the nodes that write a run's files see the folders the driver sees.

On a cluster of several machines, each rank of the actor (and the critic) writes its checkpoint shards
into ``trainer.checkpoint_dir`` and the Hugging Face export into ``trainer.run_dir``, while the driver
writes the checkpoint's marker and the metrics there: the folders must be one file system that every
such node mounts at the same path (NFS, a cluster file system). On a node that has its own disk at
that path, checkpoints would be split across machines and never complete. ``unshared_folders`` asks
each node: the driver leaves a marker file in each folder, and a task on the node looks for it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: How long a node may take to answer whether it sees the markers.
PROBE_TIMEOUT_S = 60.0


def _visible(paths: list[str]) -> list[bool]:
    import os

    return [os.path.exists(path) for path in paths]


def unshared_folders(ray: Any, folders: Mapping[str, str], nodes: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(key, message)`` for each folder of ``folders`` (config key: absolute path) that a node of
    ``nodes`` (Ray node id: what runs there, for the message) does not see as the driver does."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    markers = {}
    for key, folder in folders.items():
        Path(folder).mkdir(parents=True, exist_ok=True)
        markers[key] = Path(folder) / f".verl_core_shared_{uuid.uuid4().hex}"
        markers[key].write_text("a marker: does every node see this folder?\n")
    try:
        probe = ray.remote(num_cpus=0, max_retries=0)(_visible)
        asked = {
            node: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                [str(marker) for marker in markers.values()]
            )
            for node in nodes
        }
        problems = []
        for node, answer in asked.items():
            for (key, folder), seen in zip(
                folders.items(), ray.get(answer, timeout=PROBE_TIMEOUT_S), strict=True
            ):
                if not seen:
                    problems.append(
                        (
                            key,
                            f"{folder} is not the folder the driver sees on Ray node {node[:8]} ({nodes[node]}), "
                            "which writes into it: put it on a file system every node mounts at the same path "
                            "(NFS, a cluster file system), or run the roles on the driver's machine",
                        )
                    )
        return problems
    finally:
        for marker in markers.values():
            marker.unlink(missing_ok=True)


def writing_nodes(groups: Iterable[Any]) -> dict[str, str]:
    """The Ray nodes of ``groups``' ranks: ``{node id: "actor rank 0, actor rank 1"}``."""
    nodes: dict[str, list[str]] = {}
    for group in groups:
        for rank, node in enumerate(group.nodes):
            nodes.setdefault(node, []).append(f"{group.role} rank {rank}")
    return {node: ", ".join(ranks) for node, ranks in nodes.items()}
