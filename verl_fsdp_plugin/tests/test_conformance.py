"""The ``fsdp`` backend against verl-core's engine conformance kit (docs/conformance.md).

Exactly what a third-party plugin author writes: the kit finds the backend through the installed
distribution's entry point (``pip install -e verl_fsdp_plugin``), as a user's config would, and runs
every check at two gloo ranks, with the default options (each decoder layer and the root sharded,
fp32, no offload).

Not at one rank: there the engine runs the plain, unsharded model (a one-rank group has nothing to
shard), the path the ``ddp`` backend's one-rank kit run covers (plugins/verl_ddp/tests/
test_conformance.py). That fsdp takes that path at one rank is test_fsdp_engine.py's
``test_a_one_rank_group_runs_the_plain_model_unless_an_option_needs_fsdp``; its unsharded engine's
checkpoints are ``test_checkpoint_saved_before_the_first_step_resumes_exactly`` (test_fsdp_plugin.py)
and ``test_checkpoint_saved_at_two_ranks_loads_without_a_process_group`` (test_fsdp_engine.py).
"""

from verl_core.testing import EngineConformance


class TestFSDPConformance(EngineConformance):
    backend = "fsdp"
    world_sizes = (2,)
