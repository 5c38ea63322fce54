"""Where each rank of a job sits in an engine's parallel layout, and the rule every layout obeys.

The trainer's dispatch (``verl_core.workers.dispatch``) and the conformance kit both read it: a batch
is split over the DP size, every rank with a DP rank gets that share, and exactly one rank per DP
rank returns outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen
class Topology:
    """Where one rank of a worker group sits in its engine's parallel layout."""

    dp_rank: int
    dp_size: int
    is_output_rank: bool


def check_topologies(topologies: Sequence[Topology], role: str) -> int:
    """The DP size the ranks agree on; a layout where they do not, or where some DP rank owns no
    outputs, is an error naming the role (an engine bug: the trainer could not collect results)."""
    sizes = {t.dp_size for t in topologies}
    if len(sizes) != 1:
        raise RuntimeError(f"the {role} ranks disagree on their data-parallel size: {sorted(sizes)}")
    (dp_size,) = sizes
    owners = sorted(t.dp_rank for t in topologies if t.is_output_rank)
    if owners != list(range(dp_size)):
        raise RuntimeError(
            f"the {role} engine must mark exactly one output rank per data-parallel rank, got output ranks "
            f"for DP ranks {owners} of {dp_size}"
        )
    return dp_size
