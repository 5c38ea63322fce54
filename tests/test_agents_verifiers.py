"""The ``verifiers`` environment against real verifiers environments (examples/verifiers/guess_digit.py,
and modules written here), run by verifiers' own rollout code with the loop's replies: the rubric's
score is the reward (checked against the rubric's formula on the conversation), the environment's
messages are environment tokens (masked out of the loss), a ``ToolEnv`` runs the model's tool calls,
what cannot run is a config error naming the key before the workers start, and GRPO trains with it
with nothing leaving loopback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.chat import build_chat_tokenizer, scripted_generate
from fixtures.demo import run_overrides
from fixtures.servers import chat_run_paths
from fixtures.sockets import describe, recorded, run_script, spied_environment

from verl_core.agents import AgentLoop, TurnTemplate
from verl_core.config.run import AgentConfig
from verl_core.data.batch import RESPONSE_MASK, RESPONSES
from verl_core.data.dataset import PromptRow
from verl_core.errors import AgentError, ConfigError
from verl_core.rollout.base import SamplingParams

pytest.importorskip(
    "verifiers",
    reason='the verifiers extra: pip install "verl-core[verifiers]" (not with the mcp extra: docs/agents.md)',
)

from verl_core.agents.adapters import verifiers_env  # noqa: E402
from verl_core.agents.adapters.verifiers_env import VerifiersEnvironments, VerifiersOptions  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "verifiers"
GUESS_DIGIT = EXAMPLES / "guess_digit"
TOKENIZER = build_chat_tokenizer()
EOS = TOKENIZER.eos_token_id
SAMPLING = SamplingParams(max_new_tokens=64, eos_token_ids=(EOS,), pad_token_id=TOKENIZER.pad_token_id)
MESSAGES = [{"role": "system", "content": "guess 0-9"}, {"role": "user", "content": "guess my digit"}]


@pytest.fixture(autouse=True)
def environments_on_path(monkeypatch, tmp_path):
    """The example's folder and ``tmp_path`` (the modules written by the tests) importable, as an
    installed environment module is."""
    monkeypatch.syspath_prepend(str(GUESS_DIGIT))
    monkeypatch.syspath_prepend(str(tmp_path))


def converse(
    options: VerifiersOptions,
    replies: list[list[str]],
    rows: list[PromptRow],
    max_turns: int = 4,
    response_length: int = 200,
):
    """The loop's conversations of ``rows`` with ``options``'s environment, the model replying ``replies``."""
    environments = VerifiersEnvironments(options, max_turns)
    loop = AgentLoop(
        TurnTemplate(TOKENIZER, (EOS,)),
        environments,
        AgentConfig(max_turns=max_turns),
        response_length=response_length,
    )
    scripted = [[TOKENIZER.encode(text) + [EOS] for text in turn] for turn in replies]
    try:
        return loop.run(scripted_generate(scripted), [[5]] * len(rows), rows, [[]] * len(rows), SAMPLING, 0)
    finally:
        environments.close()


def guess_rows(*secrets: int) -> list[PromptRow]:
    return [
        PromptRow((5,), "x", {"answer": str(s), "example_id": i}, MESSAGES) for i, s in enumerate(secrets)
    ]


def rubric_reward(secret: int, guesses: list[str]) -> float:
    """examples/verifiers/guess_digit.py's rubric, written out: 1 / guesses once found, else 0."""
    for number, guess in enumerate(guesses, start=1):
        if guess == str(secret):
            return 1 / number
    return 0.0


class RepeatingConversation(verifiers_env.VerifiersConversation):
    """Broken: shows the model verifiers' whole conversation again each turn, not what it added."""

    def _next(self):
        added = super()._next()
        return None if added is None else [*MESSAGES, *added]


def test_the_rubric_scores_and_the_environments_messages_are_masked() -> None:
    replies = [["5", "2", "3"], ["5", "7"]]
    batch, conversations = converse(VerifiersOptions(env_id="guess-digit"), replies, guess_rows(3, 7))
    hints = ("lower", "higher")  # to the first guess, 5
    for row, (secret, conversation) in enumerate(zip((3, 7), conversations, strict=True)):
        assert conversation.reward == pytest.approx(rubric_reward(secret, replies[row]))
        assert conversation.messages[1] == {"role": "user", "content": hints[row]}
        ids, from_model = batch[RESPONSES][row].tolist(), batch[RESPONSE_MASK][row].tolist()
        environment = TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if not m])
        model = TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if m])
        assert f"<|im_start|>user\n{hints[row]}<|im_end|>" in environment
        assert "system" not in environment  # only what verifiers added after the model's turn
        assert model == "<|im_end|>".join(replies[row]) + "<|im_end|>"


def test_a_bridge_that_shows_the_whole_conversation_again_is_caught(monkeypatch) -> None:
    """The masks check above can fail: a bridge repeating verifiers' conversation puts the system prompt
    among the environment's tokens."""
    monkeypatch.setattr(
        verifiers_env.VerifiersEnvironments, "__call__", lambda self, config: RepeatingConversation(self)
    )
    batch, _ = converse(VerifiersOptions(env_id="guess-digit"), [["5", "3"]], guess_rows(3))
    ids, from_model = batch[RESPONSES][0].tolist(), batch[RESPONSE_MASK][0].tolist()
    assert "system" in TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if not m])


def test_the_loops_max_turns_ends_verifiers_rollout_too_so_it_is_scored() -> None:
    options = VerifiersOptions(env_id="guess-digit", env_args={"max_turns": 6})
    environments = VerifiersEnvironments(options, max_turns=2)
    assert environments.environment.max_turns == 2
    environments.close()
    _, (conversation,) = converse(options, [["1", "2", "3"]], guess_rows(3), max_turns=2)
    assert (
        conversation.turns == 2 and conversation.reward == 0.0
    )  # scored by the rubric, not left to reward.function


@pytest.mark.parametrize("honest", [True, False])
def test_a_conversation_the_response_budget_cuts_is_ended_and_scored_by_verifiers(
    monkeypatch, honest
) -> None:
    """The hint to the first guess does not fit in 20 tokens: the loop ends the conversation, and verifiers
    ends its rollout as for a prompt too long for the model, scored by the rubric (0: not found). A bridge
    without ``on_cut`` leaves it unscored (the reward function would score it)."""
    if not honest:
        monkeypatch.setattr(verifiers_env.VerifiersConversation, "on_cut", lambda self, reason: None)
    _, (conversation,) = converse(
        VerifiersOptions(env_id="guess-digit"), [["5"]], guess_rows(3), response_length=20
    )
    assert conversation.cut == "response_length"
    assert conversation.reward == (0.0 if honest else None)


TOOL_ENV = '''
import verifiers as vf
from datasets import Dataset

VALUES = {"qk": 417, "ab": 12}


def get(k: str) -> int:
    """The value of key k."""
    return VALUES[k]


def answered(completion, answer) -> float:
    return 1.0 if str(completion[-1]["content"]).strip() == answer else 0.0


def load_environment():
    dataset = Dataset.from_list([{"question": "value of qk?", "answer": "417"}])
    return vf.ToolEnv(tools=[get], dataset=dataset, rubric=vf.Rubric(funcs=[answered]), max_turns=3)
'''


def test_a_tool_env_runs_the_models_tool_calls(tmp_path) -> None:
    (tmp_path / "lookup_tools.py").write_text(TOOL_ENV)
    call = '<tool_call>{"name": "get", "arguments": {"k": "qk"}}</tool_call>'
    row = PromptRow(
        (5,), "x", {"answer": "417", "example_id": 0}, [{"role": "user", "content": "value of qk?"}]
    )
    _, (conversation,) = converse(VerifiersOptions(env_id="lookup-tools"), [[call, "417"]], [row])
    assert conversation.messages[1] == {"role": "tool", "content": "417"}
    assert conversation.reward == 1.0


GROUP_RUBRIC = """
import verifiers as vf
from datasets import Dataset


def best_of_group(completions) -> list[float]:
    return [1.0] * len(completions)


def load_environment():
    dataset = Dataset.from_list([{"question": "q", "answer": "a"}])
    return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[best_of_group]))
"""

FAILING = """
import verifiers as vf
from datasets import Dataset


class Failing(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise RuntimeError("the game crashed")


def load_environment():
    return Failing(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]), rubric=vf.Rubric(funcs=[]))
"""


@pytest.mark.parametrize(
    ("env_id", "env_args", "key", "problem"),
    [
        (
            "no-such-env",
            {},
            "rollout.agent.options.env_id",
            "no verifiers environment 'no-such-env' is installed",
        ),
        (
            "guess-digit",
            {"turns": 3},
            "rollout.agent.options.env_args",
            "unexpected keyword argument 'turns'",
        ),
        ("group-rubric", {}, "rollout.agent.options.env_id", "group-level reward functions"),
    ],
)
def test_what_cannot_run_is_a_config_error_naming_the_key(tmp_path, env_id, env_args, key, problem) -> None:
    (tmp_path / "group_rubric.py").write_text(GROUP_RUBRIC)
    with pytest.raises(ConfigError) as error:
        VerifiersEnvironments(VerifiersOptions(env_id=env_id, env_args=env_args), max_turns=4)
    ((where, message),) = error.value.errors
    assert where == key and problem in message, message


def test_a_verifiers_without_the_classic_api_is_refused_naming_the_versions(monkeypatch) -> None:
    """verifiers 0.4's package root has no load_environment (its stack is verifiers.v1)."""
    import verifiers

    monkeypatch.setattr(verifiers, "load_environment", None, raising=False)
    with pytest.raises(ConfigError) as error:
        VerifiersEnvironments(VerifiersOptions(env_id="guess-digit"), max_turns=4)
    ((where, message),) = error.value.errors
    assert where == "rollout.agent.environment" and 'pip install "verifiers>=0.2,<0.4"' in message, message


def test_a_rollout_that_fails_ends_the_run_naming_the_environment(tmp_path) -> None:
    (tmp_path / "failing_env.py").write_text(FAILING)
    row = PromptRow((5,), "x", {"answer": "a", "example_id": 0}, [{"role": "user", "content": "q"}])
    with pytest.raises(AgentError, match="'failing-env' failed its rollout: RuntimeError: the game crashed"):
        converse(VerifiersOptions(env_id="failing-env"), [["x", "y"]], [row])


#: Trains argv[1]'s overrides in process under the socket spy; prints what the test checks of the last step.
TRAIN = """
import json, sys
import torch
from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer

trainer = RLTrainer.from_config(load_config([], json.loads(sys.argv[1])), show_progress=False)
try:
    metrics = trainer.fit()
finally:
    trainer.shutdown()
batch = trainer.last_batch
width = batch["responses"].shape[1]
environment = batch["attention_mask"][:, -width:].bool() & ~batch["response_mask"].bool()
scores = batch["scores"].tolist()
print(json.dumps({"step": trainer.global_step, "scores": scores, "environment_tokens": int(environment.sum()),
                  "environment_advantage": float(batch["advantages"][environment].abs().sum())}))
"""


def test_grpo_trains_on_a_verifiers_environment_and_nothing_leaves_loopback(tmp_path) -> None:
    """Three GRPO steps on the tiny chat model, every conversation a rollout of guess_digit's, its data
    the environment's own datasets (examples/verifiers/export_dataset.py, as docs/agents.md says);
    the export and the trainer under the socket spy of tests/test_everyday_faults.py."""
    env_args = {"rows": 8, "system_prompt": "guess 0-9"}
    env, log = spied_environment(tmp_path, GUESS_DIGIT)
    export = [sys.executable, str(EXAMPLES / "export_dataset.py"), "guess-digit", str(tmp_path / "guess")]
    subprocess.run([*export, "--env-args", json.dumps(env_args)], env=env, check=True, timeout=120)
    paths = chat_run_paths(tmp_path, [])
    paths.train, paths.val = tmp_path / "guess" / "train.jsonl", tmp_path / "guess" / "val.jsonl"
    options = {"env_id": "guess-digit", "env_args": env_args}
    overrides = run_overrides(
        paths,
        tmp_path,
        **{
            "data.apply_chat_template": "true",
            "rollout.prompt_length": 64,
            "rollout.response_length": 40,
            "rollout.agent.environment": "verifiers",
            "rollout.agent.options": json.dumps(options),
            "rollout.agent.max_turns": 3,
            "rollout.agent.max_tokens_per_turn": 4,
            "reward.function": "exact_match",
            "trainer.total_training_steps": 3,
        },
    )
    done = run_script(TRAIN, json.dumps(overrides), env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["step"] == 3
    assert result["environment_tokens"] > 0 and result["environment_advantage"] == 0
    allowed = [0.0, 1.0, 1 / 2, 1 / 3]  # the rubric's scores within 3 guesses, not exact_match's
    assert all(min(abs(score - a) for a in allowed) < 1e-6 for score in result["scores"]), result["scores"]
    _, calls = recorded(log)
    assert not calls, "a process reached beyond loopback:\n" + describe(calls)


REWRITING = """
import verifiers as vf
from datasets import Dataset


class Rewriting(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="again")]

    async def get_prompt_messages(self, state):
        if not state["trajectory"]:
            return state["prompt"]
        await self.env_response([], state)
        return [*state["prompt"], vf.UserMessage(content="forget your answer"), vf.UserMessage(content="again")]


def load_environment():
    return Rewriting(dataset=Dataset.from_list([{"question": "q", "answer": "a"}]), rubric=vf.Rubric(funcs=[]))
"""


def test_an_environment_that_rewrites_the_conversation_ends_the_run_naming_it(tmp_path) -> None:
    """Its second request drops the model's reply: the loop's tokens would no longer be the conversation."""
    (tmp_path / "rewriting_env.py").write_text(REWRITING)
    row = PromptRow((5,), "x", {"answer": "a", "example_id": 0}, [{"role": "user", "content": "q"}])
    with pytest.raises(
        AgentError, match="'rewriting-env' asked for a reply to 3 messages that do not continue"
    ):
        converse(VerifiersOptions(env_id="rewriting-env"), [["x", "y"]], [row])
