"""The ``fsdp`` backend against verl-core's engine conformance kit (docs/conformance.md).

Exactly what a third-party plugin author writes: the kit finds the backend through the installed
distribution's entry point (``pip install -e verl_fsdp_plugin``), as a user's config would, and runs
every check at one and at two gloo ranks, with the default options (each decoder layer and the root
sharded, fp32, no offload).
"""

from verl_core.testing import EngineConformance


class TestFSDPConformance(EngineConformance):
    backend = "fsdp"
    world_sizes = (1, 2)
