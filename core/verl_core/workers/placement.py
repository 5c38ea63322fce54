"""Whether a Ray cluster can hold a run's processes, checked before any of them starts.

Ray queues an actor whose resources no node has, and a run whose replicas ask for more CPUs than a
node offers would wait for ever (verl #7656: its asynchronous trainer deadlocks silently that way).
``placement_problems`` refuses what cannot be placed: a process that no single node can hold, or a
resource that all the processes together need more of than the cluster has. Both are necessary
conditions, so nothing placeable is refused; a set that passes them may still not pack (Ray places
actors one by one), which the start then reports as processes that do not come up. The cluster is
the nodes alive when the run starts: an autoscaling cluster's future nodes do not count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

#: Resources every node reports that no process of ours asks for by name.
_BOOKKEEPING = ("memory", "object_store_memory")


@attrs.frozen
class Demand:
    """One process to place: what it is (``rollout replica 1``), the config key that sets its
    resources (for the message), and the Ray resources it asks for."""

    what: str
    key: str
    resources: Mapping[str, float]


def placement_problems(
    demands: Sequence[Demand], nodes: Mapping[str, Mapping[str, float]]
) -> list[tuple[str, str]]:
    """``(key, message)`` for each way ``demands`` cannot fit on ``nodes`` (node name: its resources)."""
    problems = []
    for demand in demands:
        if not any(_fits(demand.resources, offered) for offered in nodes.values()):
            problems.append(
                (
                    demand.key,
                    f"{demand.what} asks for {_describe(demand.resources)}, more than any node of the Ray "
                    f"cluster has ({_describe_nodes(nodes)}): lower {demand.key}, or start a node that has it",
                )
            )
    if problems:
        return problems
    for resource in sorted({name for demand in demands for name in demand.resources}):
        needed = sum(demand.resources.get(resource, 0.0) for demand in demands)
        offered = sum(node.get(resource, 0.0) for node in nodes.values())
        if needed > offered + 1e-9:
            keys = sorted({demand.key for demand in demands if demand.resources.get(resource)})
            askers = [demand.what for demand in demands if demand.resources.get(resource)]
            problems.append(
                (
                    keys[0],
                    f"{', '.join(askers)} ask for {needed:g} {resource} together, the Ray cluster has "
                    f"{offered:g} ({_describe_nodes(nodes)}): lower {' or '.join(keys)} (or rollout.replicas), "
                    "or add nodes",
                )
            )
    return problems


def cluster_nodes(ray: Any) -> dict[str, dict[str, float]]:
    """The alive nodes of the cluster ``ray`` is connected to: ``{address (node id): resources}``."""
    nodes = {}
    for node in ray.nodes():
        if node.get("Alive"):
            name = f"{node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', ''))[:8]})"
            nodes[name] = {
                key: float(value)
                for key, value in node.get("Resources", {}).items()
                if key not in _BOOKKEEPING
            }
    return nodes


def _fits(asked: Mapping[str, float], offered: Mapping[str, float]) -> bool:
    return all(amount <= offered.get(name, 0.0) + 1e-9 for name, amount in asked.items())


def _describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items())) or "nothing"


def _describe_nodes(nodes: Mapping[str, Mapping[str, float]]) -> str:
    if not nodes:
        return "no node alive"
    shown = []
    for name, resources in nodes.items():
        own = {key: value for key, value in resources.items() if not key.startswith("node:")}
        shown.append(f"node {name}: {_describe(own)}")
    return "; ".join(shown)
