"""The ``ddp`` backend against verl-core's engine conformance kit (docs/conformance.md).

This is all a plugin author writes: the kit finds the backend through the installed plugin's
entry point, as a user's config would, and runs every check at one and at two gloo ranks.
"""

from verl_core.testing import EngineConformance


class TestDDPConformance(EngineConformance):
    backend = "ddp"
    world_sizes = (1, 2)
    options = {"bucket_cap_mb": 1.0}  # small buckets: gradients all-reduce in several buckets
