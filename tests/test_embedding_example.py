"""examples/embedding.py (docs/embedding.md) runs: core's engine, the hf rollout and GRPO in another
stack's loop, without the trainer, finishing its steps with finite losses and a synced rollout."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).parents[1] / "examples" / "embedding.py"

torch.set_num_threads(1)


def load_example():
    spec = importlib.util.spec_from_file_location("embedding_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NamedTuple looks its module up by name
    spec.loader.exec_module(module)
    return module


def test_the_embedding_example_trains_and_syncs_the_rollout(tmp_path, capsys) -> None:
    run = load_example().main(steps=2, out_dir=tmp_path)

    assert len(run.steps) == 2
    for metrics in run.steps:
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
        assert metrics["grad_norm"] > 0 and 0.0 <= metrics["reward"] <= 1.0
    assert capsys.readouterr().out.count("reward=") == 2

    trained = dict(run.engine.get_per_tensor_param())
    rollout_weights = run.rollout.model.state_dict()
    assert trained.keys() == rollout_weights.keys()
    for name, tensor in trained.items():
        assert torch.equal(rollout_weights[name], tensor.to(rollout_weights[name].device)), name
    # The steps changed the weights: the sync is not comparing two untouched copies.
    initial = load_initial_weights(tmp_path / "model")
    assert any(not torch.equal(initial[name], tensor) for name, tensor in trained.items())


def load_initial_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))
