"""The ``vllm`` backend against verl-core's rollout conformance kit (docs/conformance.md), found through
the installed distribution's entry point as a user's config finds it: one engine, every check, one test
each. On vLLM's CPU build the ``sleep`` check is skipped (the backend declares ``sleep=False`` there:
vLLM's CPU backend has no sleep mode); test_vllm_rollout.py runs it against the same contract.

The kit's model is its tiny Qwen2 made wide enough for vLLM's CPU attention (heads of 32 dimensions),
the engine small (a 64 MiB KV cache, 32-token blocks so that the kit's prompts share whole blocks).
"""

from __future__ import annotations

import importlib.util

import pytest

from verl_core.testing import RolloutConformance, TinyModelSpec
from verl_vllm.plugin import INSTALL

if importlib.util.find_spec("vllm") is None:  # found without importing it: vLLM's import changes torch
    pytest.skip(f"vLLM is not installed: {INSTALL}", allow_module_level=True)


class TestVLLMConformance(RolloutConformance):
    backend = "vllm"
    model_spec = TinyModelSpec(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    options = {"kv_cache_megabytes": 64, "block_size": 32}

    def test_the_declared_tolerance_is_reported_with_the_measured_difference(self, rollout_report) -> None:
        """The kit measures the largest log-prob difference from the Hugging Face reference; the test
        prints it beside the tolerance the backend declares (pytest -s shows it)."""
        from verl_core.plugins import get_registry

        (measured,) = [
            comparison
            for comparison in rollout_report["log_probs"].comparisons
            if comparison.quantity == "the declared log_prob_tolerance holds"
        ]
        declared = get_registry().get("rollout_backends", "vllm").capabilities.log_prob_tolerance
        print(f"\nvllm rollout log-probs: {measured.detail}")
        assert measured.passed and measured.max_abs_diff <= declared

    def test_the_engine_shuts_down_once_the_kit_lets_the_rollout_go(self, rollout_report) -> None:
        """Nothing keeps a rollout alive behind its user's back (vLLM keeps the traceback of an import it
        caught, with every frame importing it: the rollout's, had it imported vLLM from its own call), so
        its engine, and the process group vLLM made for it, are gone with it."""
        import gc

        import torch.distributed as dist

        from verl_vllm import rollout

        gc.collect()
        assert not [other for other in rollout._ENGINES if other._shutdown.alive]
        assert not dist.is_initialized()
