"""The ``megatron`` backend against verl-core's engine conformance kit (docs/conformance.md).

As a third-party plugin author would: the kit finds the backend through the installed
distribution's entry point and runs every check, here on the CPU (``cpu_bridge``) in three layouts:
data parallelism alone (TP=1, PP=1 at two ranks; one rank against the reference is in
test_megatron_engine.py), tensor parallelism (TP=2 at two ranks:
one replica) and pipeline parallelism (PP=2 at two ranks: one replica).
"""

from verl_core.testing import EngineConformance


class TestMegatronConformance(EngineConformance):
    backend = "megatron"
    world_sizes = (2,)
    options = {"cpu_bridge": True}


class TestMegatronTensorParallelConformance(EngineConformance):
    backend = "megatron"
    world_sizes = (2,)
    options = {"cpu_bridge": True, "tensor_model_parallel_size": 2}


class TestMegatronPipelineParallelConformance(EngineConformance):
    backend = "megatron"
    world_sizes = (2,)
    options = {"cpu_bridge": True, "pipeline_model_parallel_size": 2}
