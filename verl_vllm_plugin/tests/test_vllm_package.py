"""The installed distribution as a plugin: core's ``PluginContract`` (version, core range, entry point,
light listing, no deprecated API) and, for its rollout backend, what the contract checks of engine
backends: the descriptor, the options' structure at their config paths, their documentation, and a
listing that imports neither torch nor vLLM. None of it starts an engine or needs vLLM installed."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import yaml

from verl_core.testing import PluginContract
from verl_vllm.config import VLLMRolloutConfig

DOCS = Path(__file__).parents[2] / "docs" / "backends" / "vllm.md"
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


class TestPlugin(PluginContract):
    distribution = "verl-vllm-plugin"
    package = "verl_vllm"
    entry_points = {"vllm": "verl_vllm.plugin"}
    # No engine backend (options_examples lists those); the rollout backend's tests are below.


def descriptor():
    from verl_vllm.plugin import verl_rollout_backends

    (backend,) = verl_rollout_backends()
    return backend


def test_the_descriptor_states_contract_2_what_it_needs_and_its_capabilities() -> None:
    from verl_core.descriptors import ROLLOUT_API_VERSION, load_object
    from verl_core.rollout import BaseRollout
    from verl_vllm.plugin import capabilities, cpu_build

    backend = descriptor()
    assert backend.name == "vllm" and backend.api_version == ROLLOUT_API_VERSION == 2
    assert backend.requires == ("vllm",) and 'pip install "verl-core[vllm]"' in backend.install
    rollout = load_object(backend.rollout)  # no vLLM import: check_before_start runs on the driver
    assert issubclass(rollout, BaseRollout) and rollout.options_class is load_object(backend.config)
    assert backend.capabilities == capabilities(cpu_build())
    # vLLM's CPU build has no sleep mode: sleep() would free nothing there.
    assert not capabilities(True).sleep and capabilities(False).sleep_frees_weights
    assert capabilities(True).log_prob_semantics == "tempered"


def test_listing_and_loading_the_options_import_neither_torch_nor_vllm() -> None:
    script = """
import json, sys
from verl_core.descriptors import load_object
from verl_core.plugins import get_registry

registry = get_registry()
(entry,) = [e for e in registry.entries("rollout_backends") if e.name == "vllm"]
load_object(entry.descriptor.config)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "tensordict", "vllm"))))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []


@pytest.mark.skipif(
    not VLLM_INSTALLED, reason="vLLM is not installed: the registry refuses rollout.backend=vllm"
)
def test_the_options_structure_at_their_path_and_round_trip() -> None:
    from verl_core.config import structure, unstructure
    from verl_core.config.run import RolloutConfig
    from verl_core.errors import ConfigError

    example = {"max_model_len": 4096, "block_size": 32, "engine_kwargs": {"max_num_seqs": 64}}
    config = structure({"backend": "vllm", "vllm": example}, RolloutConfig, "rollout")
    assert config.options == VLLMRolloutConfig(
        max_model_len=4096, block_size=32, engine_kwargs={"max_num_seqs": 64}
    )
    assert structure(unstructure(config), RolloutConfig) == config
    for options, path, message in (
        ({"no_such_option": 1}, "rollout.vllm.no_such_option", "unknown key"),
        ({"block_size": 48}, "rollout.vllm.block_size", "a power of two or a multiple of 32"),
        (
            {"engine_kwargs": {"logprobs_mode": "raw_logprobs"}},
            "rollout.vllm.engine_kwargs.logprobs_mode",
            "sets",
        ),
    ):
        with pytest.raises(ConfigError) as caught:
            structure({"backend": "vllm", "vllm": options}, RolloutConfig, "rollout")
        errors = dict(caught.value.errors)
        assert path in errors and message in errors[path], errors


def test_the_options_table_documents_every_option_with_its_default() -> None:
    section = DOCS.read_text().split("\n## Options")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, flags=re.MULTILINE))
    defaults = {
        field.name: field.default.factory() if isinstance(field.default, attrs.Factory) else field.default
        for field in attrs.fields(VLLMRolloutConfig)
    }
    assert sorted(rows) == sorted(defaults), f"{DOCS}: the options table lists {sorted(rows)}"
    for option, default in defaults.items():
        assert yaml.safe_load(rows[option]) == default, f"{DOCS}: `{option}` is documented as {rows[option]}"
