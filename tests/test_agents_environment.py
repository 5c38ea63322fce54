"""Environments and tools: Hermes tool-call parsing (malformed calls answered, never raised), the
built-in ``tools`` environment over a user's file (timeouts, errors), and a third-party environment
plugin found through its entry point and run by the agent loop."""

from __future__ import annotations

import json
import time

import pytest
from fixtures.chat import build_chat_tokenizer, scripted_generate
from fixtures.fake_dist import fake_distributions
from hypothesis import given
from hypothesis import strategies as st

from verl_core.agents import AgentLoop, StepResult, ToolCall, ToolEnvironment, TurnTemplate, parse_tool_calls
from verl_core.agents.environment import load_tools
from verl_core.agents.session import build_agent_loop
from verl_core.config.run import AgentConfig
from verl_core.errors import AgentError, UnknownNameError
from verl_core.plugins import Registry


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_well_formed_calls_are_parsed_in_order() -> None:
    text = "Let me compute. " + call("multiply", a=12, b=34) + " and " + call("lookup", key="x")
    parsed = parse_tool_calls(text)
    assert parsed.calls == (ToolCall("multiply", {"a": 12, "b": 34}), ToolCall("lookup", {"key": "x"}))
    assert parsed.problems == ()
    assert not parse_tool_calls("The answer is 408.").has_calls


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('<tool_call>{"name": "f", "arguments": {}}', "no closing </tool_call>"),
        ("<tool_call>{name: f}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no string 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "'arguments' is not an object"),
    ],
)
def test_malformed_calls_become_problems(text, problem) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.calls == () and len(parsed.problems) == 1 and problem in parsed.problems[0]


@given(st.text(max_size=60))
def test_parsing_never_raises(text) -> None:
    parse_tool_calls(text)
    parse_tool_calls("<tool_call>" + text)


TOOLS_FILE = """
import time

def multiply(a: int, b: int) -> int:
    return a * b

def fail(x):
    raise ValueError("bad x")

def slow():
    time.sleep(5)
    return "late"

def _helper():
    return 0
"""


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


def test_tools_come_from_the_users_file(tools_file) -> None:
    assert sorted(load_tools(tools_file)) == ["fail", "multiply", "slow"]  # public functions only
    with pytest.raises(AgentError, match=r"rollout\.agent\.tools=.*no \.py file"):
        load_tools(tools_file.with_name("missing.py"))


def test_the_tools_environment_answers_every_call_and_every_mistake(tools_file) -> None:
    environment = ToolEnvironment.from_config(
        AgentConfig(environment="tools", tools=str(tools_file), tool_timeout_s=0.2)
    )
    environment.reset(None)
    text = (
        call("multiply", a=12, b=34)
        + call("fail", x=1)
        + call("nope")
        + call("multiply", a=1)
        + "<tool_call>{oops}</tool_call>"
    )
    result = environment.step(text)
    answers = [message["content"] for message in result.observation]
    assert not result.done and [m["role"] for m in result.observation] == ["tool"] * 5
    assert answers[0].startswith("error: tool call 5 is not valid JSON")  # problems first, then calls
    assert answers[1] == "408"
    assert answers[2] == "error: fail raised ValueError: bad x"
    assert answers[3].startswith("error: there is no tool 'nope'")
    assert answers[4].startswith("error: multiply(a: int, b: int) -> int cannot take {'a': 1}")
    started = time.perf_counter()
    timed_out = environment.step(call("slow"))
    assert timed_out.observation[0]["content"] == "error: slow did not return within 0.2 s"
    assert time.perf_counter() - started < 2
    assert environment.step("The answer is 408.") == StepResult(done=True)


def test_the_tools_environment_needs_a_tools_file() -> None:
    with pytest.raises(AgentError, match=r"rollout\.agent\.tools"):
        ToolEnvironment.from_config(AgentConfig(environment="tools"))


GUESS_PLUGIN = """
from verl_core import Environment, hookimpl

@hookimpl
def verl_environments():
    return [Environment(name="guess", environment="guess_env:Guess", description="guess the row's number")]
"""

GUESS_ENV = """
from verl_core.agents import BaseEnvironment, StepResult

class Guess(BaseEnvironment):
    def __init__(self, config):
        self.config = config

    def reset(self, row):
        self.target = row["target"]

    def step(self, model_text):
        if model_text.strip() == self.target:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation={"role": "user", "content": "no"}, reward=0.0)
"""


def test_a_third_party_environment_is_found_through_its_entry_point_and_run(tmp_path) -> None:
    from verl_core.rollout.base import SamplingParams

    tokenizer = build_chat_tokenizer()
    eos = tokenizer.eos_token_id
    with fake_distributions(tmp_path) as dists:
        dists.add("verl-guess", "1.0", {"guess": GUESS_PLUGIN}, modules={"guess_env": GUESS_ENV})
        registry = Registry.from_plugins(autoload=True)
        entry = registry.entry("environments", "guess")
        assert (entry.plugin, entry.distribution) == ("guess", "verl-guess")
        config = _run_config(environment="guess")
        sampling = SamplingParams(max_new_tokens=8, eos_token_ids=(eos,), pad_token_id=0)
        loop = build_agent_loop(config, tokenizer, sampling, registry)
        assert isinstance(loop, AgentLoop) and isinstance(loop.template, TurnTemplate)
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        replies = [[encode("3") + [eos], encode("7") + [eos]], [encode("7") + [eos]]]
        _, conversations = loop.run(
            scripted_generate(replies), [[5], [5]], [{"target": "7"}] * 2, [[], []], sampling, seed=0
        )
    assert [c.turns for c in conversations] == [2, 1]
    assert [c.reward for c in conversations] == [1.0, 1.0]
    assert conversations[0].messages[1] == {"role": "user", "content": "no"}


def test_an_unknown_environment_names_the_key() -> None:
    from verl_core.rollout.base import SamplingParams

    tokenizer = build_chat_tokenizer()
    sampling = SamplingParams(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0)
    with pytest.raises(UnknownNameError, match=r"'tols' \(from rollout\.agent\.environment\)(.|\n)*'tools'"):
        build_agent_loop(_run_config(environment="tols"), tokenizer, sampling)


def _run_config(**agent):
    import attrs

    from verl_core.config.engine import EngineConfig, ModelConfig
    from verl_core.config.run import ActorConfig, RolloutConfig, RunConfig

    return RunConfig(
        actor=ActorConfig(engine=EngineConfig(backend="ddp", model=ModelConfig(path="unused"))),
        rollout=attrs.evolve(RolloutConfig(), agent=AgentConfig(**agent), response_length=64),
    )


def test_a_config_naming_an_unknown_environment_or_a_missing_tools_file_is_refused_at_load(tmp_path) -> None:
    from verl_core.config import load_config
    from verl_core.errors import ConfigError

    base = [
        "actor.engine.backend=ddp",
        "actor.engine.model.path=x",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
    ]
    with pytest.raises(ConfigError, match=r"rollout\.agent\.environment: Unknown environment 'tols'"):
        load_config([], [*base, "rollout.agent.environment=tols"])
    tools = tmp_path / "t.py"
    with pytest.raises(ConfigError, match=r"rollout\.agent\.tools: no such file: .*t\.py"):
        load_config([], [*base, "rollout.agent.environment=tools", f"rollout.agent.tools={tools}"])
    tools.write_text("def _helper():\n    pass\n")
    with pytest.raises(
        ConfigError, match=r"rollout\.agent\.tools: .*t\.py defines no public top-level function"
    ):
        load_config([], [*base, "rollout.agent.environment=tools", f"rollout.agent.tools={tools}"])
    tools.write_text("def add(a: int, b: int) -> int:\n    return a + b\n")
    loaded = load_config([], [*base, "rollout.agent.environment=tools", f"rollout.agent.tools={tools}"])
    assert loaded.rollout.agent == AgentConfig(environment="tools", tools=str(tools))
