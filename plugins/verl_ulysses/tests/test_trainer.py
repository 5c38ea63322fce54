"""GRPO through ``verl-core train`` with the ulysses backend at sp=2: two Ray workers that split every
sequence of one DP rank between them, against the same two steps with the fsdp backend on one rank.

The run uses this repository's demo (``tests/fixtures/demo.py``: a tiny Qwen2 and digit-reversal
prompts): the rollout samples the same responses from the same weights, so every loss, gradient norm
and weight must agree; the trainer dispatches by the engine's topology (DP size 1, outputs from SP
rank 0) and core needed no change for it.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.demo import run_overrides
from transformers import AutoModelForCausalLM
from verl_core.cli import main

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)

#: Loss and gradient norm of each step, and the weights after two steps (AdamW with eps 1e-4 keeps
#: the weights' rounding differences near the gradients').
TOLERANCE = 1e-5


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_grpo_steps_at_sp2_under_ray_equal_fsdp_on_one_rank(demo, tmp_path, ray_cluster) -> None:
    common = {"actor.engine.optim.eps": 1e-4, "trainer.save_hf_model": "true"}
    assert main(["train", *run_overrides(demo, tmp_path / "fsdp", backend="fsdp", **common)]) == 0
    ulysses = {"actor.engine.ulysses.sp_size": 2, "trainer.workers": "ray", "trainer.world_size": 2}
    assert (
        main(["train", *run_overrides(demo, tmp_path / "sp2", backend="ulysses", **ulysses, **common)]) == 0
    )

    expected, actual = metrics(tmp_path / "fsdp" / "run"), metrics(tmp_path / "sp2" / "run")
    assert [line["step"] for line in actual] == [line["step"] for line in expected] == [1, 2]
    for step, (mine, theirs) in enumerate(zip(actual, expected, strict=True), start=1):
        assert mine["reward/mean"] == theirs["reward/mean"], f"step {step}: other responses were sampled"
        for key in ("actor/loss", "actor/grad_norm"):
            assert abs(mine[key] - theirs[key]) <= TOLERANCE, (step, key, mine[key], theirs[key])
    assert expected[0]["actor/grad_norm"] > 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "sp2" / "run" / "hf_model").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "run" / "hf_model").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(demo.model).state_dict()
    assert list(trained) == list(reference)
    assert max(float((reference[n] - initial[n]).abs().max()) for n in reference) > 1e-4  # it trained
    for name, tensor in reference.items():
        torch.testing.assert_close(trained[name], tensor, atol=TOLERANCE, rtol=0, msg=name)
