"""GRPO through verl-core's trainer with the megatron backend at TP=2: two Ray workers that are one
model replica (DP size 1), on the demo's tiny Qwen2 (17 tokens: a vocabulary TP=2 pads)."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.demo import run_overrides
from transformers import AutoModelForCausalLM

from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)


def test_two_grpo_steps_at_tensor_parallel_size_2_under_ray(demo, tmp_path, ray_cluster) -> None:
    overrides = run_overrides(
        demo,
        tmp_path,
        backend="megatron",
        **{
            "actor.engine.megatron.tensor_model_parallel_size": 2,
            "actor.engine.megatron.cpu_bridge": "true",
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "trainer.save_freq": 2,
            "trainer.save_hf_model": "true",
        },
    )
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        assert trainer.actor.dp_size == 1  # the two ranks split each layer: one replica
        final = trainer.fit()
    finally:
        trainer.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["actor/grad_norm"] > 0 and 0.0 <= line["reward/mean"] <= 1.0
    assert final["actor/lr"] == pytest.approx(1e-3)
    assert (tmp_path / "checkpoints" / "global_step_2" / "actor" / "verl_checkpoint.json").is_file()
    # The export has the Hugging Face vocabulary again (megatron-core held 18 rows at TP=2).
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model")
    initial = AutoModelForCausalLM.from_pretrained(demo.model)
    assert (
        exported.get_input_embeddings().weight.shape
        == initial.get_input_embeddings().weight.shape
        == (17, 64)
    )
    assert not torch.equal(exported.lm_head.weight, initial.lm_head.weight)  # trained
