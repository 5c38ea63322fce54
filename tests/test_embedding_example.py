"""examples/embedding.py (docs/embedding.md) runs: core's engine, the hf rollout and GRPO in another
stack's loop, without the trainer, finishing its steps with finite losses and a synced rollout."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import textwrap
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


DOC = Path(__file__).parents[1] / "docs" / "embedding.md"


def test_the_example_prints_what_the_docs_show() -> None:
    """``python examples/embedding.py --steps 3``, as docs/embedding.md says to run it."""
    shown = re.search(r"```\n(step 1: .*?)```", DOC.read_text(), re.S).group(1).splitlines()
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=EXAMPLE.parents[1],
    )
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("step ")] == shown


def test_the_step_by_step_snippets_run_in_order(tmp_path, monkeypatch) -> None:
    """The snippets of "Step by step" are one script (then the mini-batch one of "Going further"),
    on the demo's model and data at runs/demo, as the page says."""
    text = DOC.read_text()
    steps = text[text.index("## Step by step") : text.index("## Going further")]
    further = text[text.index("## Going further") :]
    blocks = re.findall(r"```python\n(.*?)```", steps, re.S)
    blocks += [textwrap.dedent(block) for block in re.findall(r"  ```python\n(.*?)  ```", further, re.S)]
    load_example().build_demo(tmp_path / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)
    assert math.isfinite(namespace["metrics"]["loss"]) and namespace["metrics"]["grad_norm"] > 0
    assert namespace["scores"].shape == (32,)
