"""The RL trainer with multi-turn rollouts, in process on the tiny chat model: a third-party environment
(found through its entry point) that answers every turn, so that every response holds environment
tokens; its reward replaces the reward function's; one training step and a validation run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from fixtures.chat import build_chat_model_dir
from fixtures.demo import run_overrides
from fixtures.fake_dist import fake_distributions

from verl_core.config import load_config
from verl_core.data.batch import ATTENTION_MASK, RESPONSE_MASK, RESPONSES, ROLLOUT_LOG_PROBS, SCORES
from verl_core.plugins import Registry
from verl_core.trainer.rl import RLTrainer
from verl_core.trainer.run_files import validation_samples_path

ECHO_PLUGIN = """
from verl_core import Environment, hookimpl

@hookimpl
def verl_environments():
    return [Environment(name="echo", environment="echo_env:Echo")]
"""

ECHO_ENV = """
from verl_core.agents import BaseEnvironment, StepResult

class Echo(BaseEnvironment):
    '''Answers every turn with the row's hint; scores 1 when the model's text holds the target.'''

    def __init__(self, config):
        pass

    def reset(self, row):
        self.extra = row.extra

    def step(self, model_text):
        reward = 0.25 + 0.5 * (self.extra["target"] in model_text)
        return StepResult(observation={"role": "user", "content": self.extra["hint"]}, reward=reward)
"""


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus", "gae"])
def test_a_training_step_with_an_environment(tmp_path, estimator) -> None:
    model = build_chat_model_dir(tmp_path / "model")
    rows = [{"prompt": f"say {n}", "target": str(n), "hint": "again", "ground_truth": "x"} for n in range(4)]
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    paths = SimpleNamespace(model=model, train=tmp_path / "train.jsonl", val=tmp_path / "val.jsonl")
    overrides = run_overrides(
        paths,
        tmp_path,
        **{
            "data.apply_chat_template": "true",
            "rollout.prompt_length": 32,
            "rollout.response_length": 40,
            "rollout.agent.environment": "echo",
            "rollout.agent.max_turns": 3,
            "rollout.agent.max_tokens_per_turn": 6,
            "reward.function": "exact_match",
            "algorithm.adv_estimator": estimator,
            "trainer.total_training_steps": 1,
            "trainer.test_freq": 1,
            "trainer.val_n": 2,
        }
        | (
            {
                "critic.enable": "true",
                "critic.engine": f"{{backend: ddp, model: {{path: {model}}}, device: cpu, optim: {{lr: 1e-3}}}}",
            }
            if estimator == "gae"
            else {}
        ),
    )
    with fake_distributions(tmp_path) as dists:
        dists.add("verl-echo", "1.0", {"echo": ECHO_PLUGIN}, modules={"echo_env": ECHO_ENV})
        registry = Registry.from_plugins(autoload=True)
        config = load_config([], overrides, registry=registry)
        trainer = RLTrainer.from_config(config, registry=registry, show_progress=False)
        try:
            trainer.fit()
        finally:
            trainer.shutdown()
    batch = trainer.last_batch
    width = batch[RESPONSES].shape[1]
    real = batch[ATTENTION_MASK][:, -width:].bool()
    model_tokens = batch[RESPONSE_MASK].bool()
    environment = real & ~model_tokens
    assert environment.any(dim=-1).all()  # every response got at least one answer
    assert not batch[ROLLOUT_LOG_PROBS][environment].any()
    for key in ("advantages", "returns", "token_level_rewards", *(["values"] if estimator == "gae" else [])):
        assert not batch[key][environment].any(), key
    assert set(batch[SCORES].tolist()) <= {0.25, 0.75}  # the environment's reward, not exact_match's 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = lines[-1]
    assert step["response_length/mean"] == pytest.approx(float(model_tokens.sum()) / len(model_tokens))
    assert all(torch.isfinite(torch.tensor(value)) for key, value in step.items() if key.startswith("actor/"))
    samples = [
        json.loads(line) for line in validation_samples_path(tmp_path / "run", 1).read_text().splitlines()
    ]
    assert samples and all("again" in sample["response"] for sample in samples)  # whole conversations
    first = samples[0]["turns"]  # marked by who wrote them, special tokens kept
    assert list(first[0]) == ["model"] and list(first[1]) == ["environment"]
    assert "<|im_start|>user\nagain<|im_end|>" in first[1]["environment"]
