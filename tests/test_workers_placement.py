"""The placement check: what a Ray cluster cannot hold is refused, what it can is not (against an
exhaustive search for an assignment of the processes to the nodes)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.workers.placement import Demand, placement_problems

RESOURCES = ("CPU", "GPU", "rollout")
amounts = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])


def placeable(demands: list[Demand], nodes: dict[str, dict[str, float]]) -> bool:
    """Whether some assignment of every demand to a node fits each node's resources."""
    for assignment in itertools.product(list(nodes), repeat=len(demands)):
        used = {name: dict.fromkeys(RESOURCES, 0.0) for name in nodes}
        for demand, node in zip(demands, assignment, strict=True):
            for resource, amount in demand.resources.items():
                used[node][resource] += amount
        if all(
            used[node][resource] <= nodes[node].get(resource, 0.0) + 1e-9
            for node in nodes
            for resource in RESOURCES
        ):
            return True
    return False


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.dictionaries(st.sampled_from(RESOURCES), amounts), min_size=1, max_size=4),
    st.lists(st.dictionaries(st.sampled_from(RESOURCES), amounts), min_size=1, max_size=3),
)
def test_nothing_placeable_is_refused_and_what_one_node_cannot_hold_always_is(asks, offers) -> None:
    demands = [Demand(f"replica {i}", "rollout.replica_resources", ask) for i, ask in enumerate(asks)]
    nodes = {f"node {i}": offer for i, offer in enumerate(offers)}
    problems = placement_problems(demands, nodes)
    if placeable(demands, nodes):
        assert problems == []
    fits_somewhere = [
        any(all(amount <= offer.get(name, 0.0) for name, amount in ask.items()) for offer in offers)
        for ask in asks
    ]
    if not all(fits_somewhere):
        assert problems and all(key == "rollout.replica_resources" for key, _ in problems)


def test_the_message_names_the_process_the_key_and_the_nodes() -> None:
    nodes = {"10.0.0.1 (ab12cd34)": {"CPU": 2.0}, "10.0.0.2 (ef56ab78)": {"CPU": 4.0, "GPU": 1.0}}
    (problem,) = placement_problems(
        [Demand("rollout replica 0", "rollout.replica_resources", {"CPU": 8})], nodes
    )
    assert problem == (
        "rollout.replica_resources",
        "rollout replica 0 asks for 8 CPU, more than any node of the Ray cluster has (node 10.0.0.1 (ab12cd34): "
        "2 CPU; node 10.0.0.2 (ef56ab78): 4 CPU, 1 GPU): lower rollout.replica_resources, or start a node "
        "that has it",
    )
    demands = [Demand(f"rollout replica {i}", "rollout.replica_resources", {"CPU": 3}) for i in range(3)]
    ((key, message),) = placement_problems(demands, nodes)
    assert key == "rollout.replica_resources"
    assert message.startswith(
        "rollout replica 0, rollout replica 1, rollout replica 2 ask for 9 CPU together"
    )
