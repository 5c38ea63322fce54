"""The RL trainer with multi-turn rollouts on the tiny chat model: a third-party environment (found
through its entry point) that answers every turn, so that every response holds environment tokens; its
reward replaces the reward function's; one training step and a validation run, in process, and on two
data-parallel ranks under Ray with conversations that end at different turns."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from fixtures.demo import run_overrides
from fixtures.fake_dist import fake_distributions
from fixtures.servers import chat_run_paths

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
    '''Answers every turn with the row's hint and rewards the model's text; ends the conversation
    after the row's ``turns`` model turns, when it has that column.'''

    def __init__(self, config):
        pass

    def reset(self, row):
        self.extra = row.extra
        self.turns = 0

    def step(self, model_text):
        self.turns += 1
        # 0.75 for the target; else 0.25 or 0.5 by the text's length, so that a group's rewards vary
        # (dynamic sampling keeps only such groups) whatever the untrained model writes.
        reward = 0.75 if self.extra["target"] in model_text else 0.25 + 0.25 * (len(model_text) % 2)
        done = self.turns == self.extra.get("turns")
        return StepResult(observation={"role": "user", "content": self.extra["hint"]}, done=done, reward=reward)
"""


#: The run's settings for each algorithm (``dapo``: GRPO with dynamic sampling).
ALGORITHMS = {
    "grpo": {},
    "rloo": {"algorithm.adv_estimator": "rloo"},
    "reinforce_plus_plus": {"algorithm.adv_estimator": "reinforce_plus_plus"},
    "dapo": {"algorithm.filter_groups.enable": "true", "algorithm.filter_groups.max_num_gen_batches": 4},
}


def echo_rows(count: int, **columns) -> list[dict]:
    """``count`` dataset rows for the ``echo`` environment; ``columns`` maps a column to its values."""
    rows = [
        {"prompt": f"say {n}", "target": str(n), "hint": "again", "ground_truth": "x"} for n in range(count)
    ]
    for column, values in columns.items():
        for row, value in zip(rows, values, strict=True):
            row[column] = value
    return rows


def echo_run(
    tmp_path, folder: str = ".", train_rows: list | None = None, val_rows: list | None = None, **changes
) -> tuple[RLTrainer, dict]:
    """A run (in process unless ``changes`` say otherwise) on the tiny chat model whose every turn the
    third-party ``echo`` environment answers, on 4 prompts unless given: the trainer (shut down) and
    the last step's metrics."""
    train_rows = echo_rows(4) if train_rows is None else train_rows
    paths = chat_run_paths(tmp_path, train_rows, echo_rows(4) if val_rows is None else val_rows)
    settings = {
        "data.apply_chat_template": "true",
        "rollout.prompt_length": 32,
        "rollout.response_length": 40,
        "rollout.agent.environment": "echo",
        "rollout.agent.max_turns": 3,
        "rollout.agent.max_tokens_per_turn": 6,
        "reward.function": "exact_match",
        "trainer.total_training_steps": 1,
        "trainer.test_freq": 1,
        "trainer.val_n": 2,
    }
    overrides = run_overrides(paths, tmp_path / folder, **(settings | changes))
    with fake_distributions(Path(tempfile.mkdtemp(dir=tmp_path))) as dists:
        dists.add("verl-echo", "1.0", {"echo": ECHO_PLUGIN}, modules={"echo_env": ECHO_ENV})
        registry = Registry.from_plugins(autoload=True)
        config = load_config([], overrides, registry=registry)
        trainer = RLTrainer.from_config(config, registry=registry, show_progress=False)
        try:
            metrics = trainer.fit()
        finally:
            trainer.shutdown()
    return trainer, metrics


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "dapo", "gae"])
def test_a_training_step_with_an_environment(tmp_path, estimator) -> None:
    critic = {}
    if estimator == "gae":
        critic = {
            "algorithm.adv_estimator": "gae",
            "critic.enable": "true",
            "critic.engine": f"{{backend: ddp, model: {{path: {tmp_path / 'model'}}}, device: cpu, optim: {{lr: 1e-3}}}}",
        }
    trainer, _ = echo_run(tmp_path, **ALGORITHMS.get(estimator, {}), **critic)
    batch = trainer.last_batch
    width = batch[RESPONSES].shape[1]
    real = batch[ATTENTION_MASK][:, -width:].bool()
    model_tokens = batch[RESPONSE_MASK].bool()
    environment = real & ~model_tokens
    assert environment.any(dim=-1).all()  # every response got at least one answer
    assert not batch[ROLLOUT_LOG_PROBS][environment].any()
    for key in ("advantages", "returns", "token_level_rewards", *(["values"] if estimator == "gae" else [])):
        assert not batch[key][environment].any(), key
    assert set(batch[SCORES].tolist()) <= {0.25, 0.5, 0.75}  # the environment's reward, not exact_match's 0
    if estimator == "dapo":  # dynamic sampling kept only groups whose environment rewards vary
        assert all((group != group[0]).any() for group in batch[SCORES].view(-1, 4))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = lines[-1]
    assert step["response_length/mean"] == pytest.approx(float(model_tokens.sum()) / len(model_tokens))
    if estimator != "dapo":  # (dynamic sampling's metrics cover the responses it dropped too)
        # Model turns are the runs of model tokens; the environment answers every turn, so each
        # conversation was cut, by max_turns (3) or by the response budget.
        turns = (model_tokens[:, 1:] & ~model_tokens[:, :-1]).sum(dim=-1) + model_tokens[:, 0]
        assert step["agent/turns/mean"] == pytest.approx(turns.float().mean().item())
        assert step["agent/turns/max"] == turns.max().item()
        assert step["agent/cut/max_turns"] + step["agent/cut/response_length"] == pytest.approx(1.0)
    assert all(torch.isfinite(torch.tensor(value)) for key, value in step.items() if key.startswith("actor/"))
    samples = [
        json.loads(line) for line in validation_samples_path(tmp_path / "run", 1).read_text().splitlines()
    ]
    assert samples and all("again" in sample["response"] for sample in samples)  # whole conversations
    first = samples[0]["turns"]  # marked by who wrote them, special tokens kept
    assert list(first[0]) == ["model"] and list(first[1]) == ["environment"]
    assert "<|im_start|>user\nagain<|im_end|>" in first[1]["environment"]


def test_a_run_with_an_environment_resumes_exactly(tmp_path) -> None:
    """Step 2 resumed from step 1's checkpoint is the uninterrupted run's step 2: the conversations
    (sampled turn by turn) and what they trained."""
    straight, expected = echo_run(tmp_path, "straight", **{"trainer.total_training_steps": 2})
    echo_run(tmp_path, "resumed", **{"trainer.total_training_steps": 1, "trainer.save_freq": 1})
    resumed, final = echo_run(tmp_path, "resumed", **{"trainer.total_training_steps": 2})
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "global_step_1"
    assert torch.equal(resumed.last_batch[RESPONSES], straight.last_batch[RESPONSES])
    assert torch.equal(resumed.last_batch[RESPONSE_MASK], straight.last_batch[RESPONSE_MASK])
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean"):
        assert final[key] == expected[key], key


#: Tools files that parse, and whose every top-level import is installed, but that fail when they run:
#: (the file, what importing it raises, the line).
FAILING_TOOLS = {
    "module level": (
        "import json\n\nTABLE = json.loads('{')\n\n\ndef get(k):\n    return TABLE[k]\n",
        "JSONDecodeError",
        3,
    ),
    "a dependency": (
        "import os\n\nif os.sep:\n    import not_installed_anywhere\n\n\ndef get(k):\n    return k\n",
        "ModuleNotFoundError: No module named 'not_installed_anywhere'",
        4,
    ),
    "sys.exit": ("import sys\n\n\ndef get(k):\n    return k\n\n\nsys.exit(0)\n", "SystemExit: 0", 8),
}


@pytest.mark.parametrize("failure", sorted(FAILING_TOOLS))
def test_a_tools_file_that_fails_on_import_is_refused_before_any_worker_starts(
    demo, tmp_path, monkeypatch, failure
) -> None:
    """It was refused at the first step, after start-up (and a sys.exit(0) in it ended the run with
    exit 0); now it is a config error at rollout.agent.tools naming the file, the line and the cause,
    before the roles are built."""
    from verl_core.errors import ConfigError

    source, cause, line = FAILING_TOOLS[failure]
    tools = tmp_path / "tools.py"
    tools.write_text(source)
    agent = {"rollout.agent.environment": "tools", "rollout.agent.tools": str(tools)}
    config = load_config([], run_overrides(demo, tmp_path, **agent))  # the config's load only parses it

    def no_workers(*args, **kwargs):
        raise AssertionError("the roles' workers were started")

    monkeypatch.setattr("verl_core.trainer.build.build_roles", no_workers)
    with pytest.raises(ConfigError) as error:
        RLTrainer.from_config(config, show_progress=False)
    ((key, message),) = error.value.errors
    assert key == "rollout.agent.tools"
    assert f"importing {tools} raised {cause}" in message and f"at line {line} of tools.py" in message


def model_turns(batch, row: int) -> int:
    """How many model turns response ``row`` holds: its runs of ``response_mask`` 1."""
    mask = batch[RESPONSE_MASK][row].tolist()
    return sum(1 for i, value in enumerate(mask) if value and (i == 0 or not mask[i - 1]))


@pytest.mark.distributed
def test_a_multi_turn_lora_run_on_two_ddp_ranks_under_ray_generates_odd_counts_of_conversations(
    tmp_path, ray_cluster
) -> None:
    """At 2 DP ranks every turn generates for the conversations still going: 6 in the first turn of a
    step, 3 in the second (one prompt's 3 end after one turn); 3 then 2 in the validations. Each rank
    generates its share, one rank one more. The policy is a LoRA adapter on ddp, its reference the
    base model (the adapter disabled) for the KL loss."""
    trainer, final = echo_run(
        tmp_path,
        train_rows=echo_rows(2, turns=[1, 3]),
        val_rows=echo_rows(3, turns=[1, 3, 3]),
        **{
            "trainer.workers": "ray",
            "trainer.world_size": 2,
            "data.train_batch_size": 2,
            "actor.ppo_mini_batch_size": 2,
            "rollout.n": 3,
            "trainer.val_n": 1,
            "actor.engine.model.lora_rank": 8,
            "actor.policy_loss.use_kl_loss": "true",
        },
    )
    assert trainer.actor.dp_size == 2
    batch = trainer.last_batch
    assert sorted(model_turns(batch, row) for row in range(6)) == [1, 1, 1, 2, 2, 2]
    assert "timing/ref_log_probs" in final
    assert all(
        torch.isfinite(torch.tensor(value)) for key, value in final.items() if key.startswith("actor/")
    )
    assert set(batch[SCORES].tolist()) <= {0.25, 0.5, 0.75}
    for step in (0, 1):
        samples = validation_samples_path(tmp_path / "run", step).read_text().splitlines()
        turns = sorted(sum("model" in turn for turn in json.loads(line)["turns"]) for line in samples)
        assert turns == [1, 2, 2]


def test_conversations_on_two_separate_replicas_train_one_step_off_each_on_its_replica(
    tmp_path, monkeypatch
) -> None:
    """With the rollout in replicas, each conversation sends its own turns as requests to the replica
    its session maps to: both replicas serve, and each conversation's turns all go to one replica."""
    from verl_core.workers import replicas

    served: dict[int, list[int]] = {}  # replica: the conversations (first prompts) it served
    generate_request = replicas.RolloutReplicas.generate_request

    async def record(self, request, session):
        served.setdefault(self.replica_for(session), []).append(session)
        return await generate_request(self, request, session)

    monkeypatch.setattr(replicas.RolloutReplicas, "generate_request", record)
    trainer, metrics = echo_run(
        tmp_path,
        **{
            "rollout.placement": "separate",
            "rollout.replicas": 2,
            "async_training.mode": "one_step_off",
            "trainer.total_training_steps": 2,
        },
    )
    assert metrics["agent/turns/mean"] >= 1 and metrics["async/staleness/max"] == 1
    assert sorted(served) == [0, 1]  # the sessions spread over both replicas
    sessions = [set(sessions) for sessions in served.values()]
    assert not sessions[0] & sessions[1]  # no conversation on two replicas
    assert all(len(s) < len(v) for s, v in zip(sessions, served.values(), strict=True))  # several turns each
