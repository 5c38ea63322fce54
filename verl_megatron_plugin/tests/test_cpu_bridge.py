"""The CPU bridge (``verl_megatron.cpu_bridge``) is opt-in, never applied on import or where CUDA
is, and does what it says. Its effect is process-wide, so what enables it runs in a subprocess: one
for both of the tests that need one (importing megatron-core there costs seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from verl_core.config.engine import EngineConfig, ModelConfig
from verl_core.errors import ConfigError
from verl_megatron import cpu_bridge
from verl_megatron.config import MegatronConfig
from verl_megatron.engine import MegatronEngine

#: What runs in one fresh process, in order (each part's failure is recorded, the next still runs):
#: importing the plugin patches nothing; then, enabled, the bridge does what it says.
PARTS = {
    "importing_patches_nothing": """
        import torch
        original = (torch.cuda.current_device, torch.cuda.synchronize)
        import verl_megatron.plugin, verl_megatron.engine, verl_megatron.cpu_bridge, verl_megatron.model
        assert (torch.cuda.current_device, torch.cuda.synchronize) == original
        assert not verl_megatron.cpu_bridge.is_enabled()
        from torch.overrides import _get_current_function_mode_stack
        assert not _get_current_function_mode_stack()
        """,
    "enabled": """
        import torch
        from verl_megatron import cpu_bridge
        cpu_bridge.enable()
        cpu_bridge.enable()  # idempotent
        made = torch.zeros(2, device="cuda")
        assert made.device.type == "cpu" and made.cuda() is made
        assert made.type() == "torch.cuda.FloatTensor" and torch.cuda.current_device() == torch.device("cpu")
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        tracker = get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 1234)
        torch.manual_seed(0)
        before = torch.get_rng_state()
        with tracker.fork():
            first = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
        with tracker.fork():
            second = torch.rand(3)
        assert not torch.equal(first, second)  # the tracker's own stream advanced
        generator = torch.Generator().manual_seed(1234)
        assert torch.equal(first, torch.rand(3, generator=generator))
        """,
}

RUNNER = """
import json, sys, textwrap, traceback
failures = {}
for name, code in json.loads(sys.argv[1]).items():
    try:
        exec(textwrap.dedent(code), {})
        failures[name] = None
    except BaseException:
        failures[name] = traceback.format_exc()
print(json.dumps(failures))
"""


@pytest.fixture(scope="module")
def fresh_process() -> dict[str, str | None]:
    """Why each of ``PARTS`` failed (None: it did not), run in turn in one fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(PARTS)], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_plugin_patches_nothing(fresh_process):
    assert fresh_process["importing_patches_nothing"] is None, fresh_process["importing_patches_nothing"]


def test_it_refuses_a_machine_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(cpu_bridge.BridgeRefused, match="unset engine.megatron.cpu_bridge"):
        cpu_bridge.enable()
    assert not cpu_bridge.is_enabled()


def test_once_enabled_cuda_tensors_and_the_rng_tracker_live_on_the_cpu(fresh_process):
    assert fresh_process["enabled"] is None, fresh_process["enabled"]


def engine(options: MegatronConfig, device: str = "cpu", **model: object) -> MegatronEngine:
    return MegatronEngine(
        EngineConfig(
            backend="megatron", model=ModelConfig(path="unused", **model), options=options, device=device
        ),
        config_path="actor.engine",
    )


def test_the_engine_on_the_cpu_asks_for_the_bridge_by_its_path():
    with pytest.raises(ConfigError) as caught:
        engine(MegatronConfig()).initialize()
    [(path, message)] = caught.value.errors
    assert (
        path == "actor.engine.megatron.cpu_bridge" and "set actor.engine.megatron.cpu_bridge: true" in message
    )


def test_the_engine_needs_a_process_group():
    with pytest.raises(ConfigError, match="init_process_group"):
        engine(MegatronConfig(cpu_bridge=True)).initialize()
    assert not cpu_bridge.is_enabled()  # refused before anything was patched


def test_compiling_hugging_face_layers_is_refused_by_its_path():
    with pytest.raises(ConfigError) as caught:
        engine(MegatronConfig(cpu_bridge=True), compile_layers=True).initialize()
    [(path, message)] = caught.value.errors
    assert path == "actor.engine.model.compile_layers" and "unset it" in message
