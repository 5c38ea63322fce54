"""Environments and tools: Hermes tool-call parsing (malformed calls answered, never raised), the
built-in ``tools`` environment over a user's file (timeouts, errors), and a third-party environment
plugin found through its entry point and run by the agent loop."""

from __future__ import annotations

import inspect
import json
import keyword
import signal
import subprocess
import sys
import time

import pytest
from fixtures.chat import build_chat_tokenizer, scripted_generate
from fixtures.fake_dist import fake_distributions
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_core.agents import (
    AgentLoop,
    ParsedReply,
    StepResult,
    ToolCall,
    ToolEnvironment,
    TurnTemplate,
    parse_tool_calls,
)
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


#: Any character, lone surrogates included (``st.text()`` leaves them out).
ANY_CHARACTER = st.characters(codec=None, categories=None)
#: JSON values Python's parser takes but that are no JSON text, or that it cannot take at all.
ADVERSARIAL_VALUES = st.one_of(
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),  # past the parser's recursion
    st.integers(1, 3000).map(lambda depth: '{"a":' * depth + "1" + "}" * depth),
    st.integers(4301, 20_000).map(lambda digits: "9" * digits),  # past int's string-conversion limit
    st.sampled_from(["NaN", "-Infinity", "Infinity", "1e999", "-1e400"]),
    st.sampled_from(['"\\ud800"', '"a\\udfffb"', '{"\\udc00": 1}', '["\\ud83d"]']),
    st.text(ANY_CHARACTER, max_size=8).map(json.dumps),
)


@st.composite
def adversarial_calls(draw) -> str:
    """A tool call whose JSON holds an adversarial value somewhere: the whole call, its name, its
    arguments (as an object or as a JSON string) or one argument."""
    value = draw(ADVERSARIAL_VALUES)
    form = draw(st.sampled_from(["call", "name", "arguments", "argument", "string arguments"]))
    body = {
        "call": value,
        "name": f'{{"name": {value}, "arguments": {{}}}}',
        "arguments": f'{{"name": "echo", "arguments": {value}}}',
        "argument": f'{{"name": "echo", "arguments": {{"x": {value}}}}}',
        "string arguments": f'{{"name": "echo", "arguments": {json.dumps(value)}}}',
    }[form]
    return draw(st.text(max_size=10)) + f"<tool_call>{body}</tool_call>" + draw(st.text(max_size=10))


def _is_text(value) -> bool:
    """Whether ``value`` is JSON text: written back as JSON with NaN and infinities refused, its
    strings kept as they are, it encodes as UTF-8 (a lone surrogate does not). The parser nests up to
    its recursion limit: writing gets more room."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 10_000)
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        return False
    finally:
        sys.setrecursionlimit(limit)
    return True


@given(st.text(ANY_CHARACTER, max_size=200))
def test_parsing_any_text_never_raises(text) -> None:
    for reply in (text, "<tool_call>" + text):
        parsed = parse_tool_calls(reply)
        assert isinstance(parsed, ParsedReply) and parsed.has_calls == ("<tool_call>" in reply)
        assert all(_is_text(call.name) and _is_text(call.arguments) for call in parsed.calls)


@given(adversarial_calls())
def test_parsing_adversarial_json_never_raises_and_refuses_what_is_no_json_text(text) -> None:
    """Deep nesting, huge integers, NaN and infinities, lone surrogates (docs/agents.md: nothing the
    model writes crashes the run): the one call is parsed into JSON text only, or reported as a
    problem with its number."""
    parsed = parse_tool_calls(text)
    assert isinstance(parsed, ParsedReply) and len(parsed.calls) + len(parsed.problems) == 1
    assert all(_is_text(call.name) and _is_text(call.arguments) for call in parsed.calls)
    assert all(problem.startswith("tool call 1 ") for problem in parsed.problems)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("[" * 5000 + "]" * 5000, "not valid JSON (nested too deeply)"),
        ("1" * 100_000, "not valid JSON (a number with too many digits)"),
        ("NaN", "not valid JSON (NaN is not a JSON value)"),
        ("1e999", "not valid JSON (1e999 is too large for a number)"),
        ('"\\ud800"', "not valid JSON (a lone surrogate '\\ud800' in a string)"),
    ],
)
def test_adversarial_json_is_a_malformed_call(value, problem) -> None:
    for body in (value, f'{{"name": "echo", "arguments": {{"x": {value}}}}}'):
        parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert parsed.calls == () and len(parsed.problems) == 1
        assert parsed.problems[0].startswith(f"tool call 1 is {problem}"), parsed.problems[0]
    # The arguments written as a JSON string: the string is not an object.
    parsed = parse_tool_calls(f'<tool_call>{{"name": "echo", "arguments": {json.dumps(value)}}}</tool_call>')
    assert parsed.problems == (
        'tool call 1 (echo): \'arguments\' is not an object; expected {"name": "<tool>", "arguments": {...}}',
    )


@given(st.one_of(st.text(ANY_CHARACTER, max_size=200), adversarial_calls()))
def test_the_tools_environment_answers_any_text_with_text(text) -> None:
    """Whatever the model writes, the tools environment answers with messages a tokenizer can encode
    (an echo tool returns what it was given)."""
    environment = ToolEnvironment({"echo": lambda x=None: x}, timeout_s=5)
    result = environment.step(text)
    for message in result.observation:
        message["content"].encode("utf-8")


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
    return written(tmp_path / "my_tools.py", TOOLS_FILE)


def written(path, text: str):
    path.write_text(text)
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


BAD_TOOLS_FILE = """
import sys
import time

def stuck():
    print("stuck: called", flush=True)
    time.sleep(3600)

def leave():
    sys.exit(0)

def interrupt():
    raise KeyboardInterrupt

class Odd(BaseException):
    pass

def odd():
    raise Odd("not an Exception")

def circular():
    loop = []
    loop.append(loop)
    return loop

def surrogate():
    return "half \\ud800 a pair"
"""

#: The tools environment as the agent loop uses it, in a process of its own: the answers to one turn
#: (argv: the tools file, tool_timeout_s, the model's text), printed as JSON; then the process ends.
ONE_TURN = """
import json, sys
from verl_core.agents.environment import ToolEnvironment
from verl_core.config.run import AgentConfig

config = AgentConfig(environment="tools", tools=sys.argv[1], tool_timeout_s=float(sys.argv[2]))
environment = ToolEnvironment.from_config(config)
environment.reset(None)
print(json.dumps([message["content"] for message in environment.step(sys.argv[3]).observation]), flush=True)
"""


@pytest.fixture
def bad_tools_file(tmp_path):
    return written(tmp_path / "bad_tools.py", BAD_TOOLS_FILE)


def test_a_tool_that_never_returns_holds_neither_the_run_nor_its_exit(bad_tools_file) -> None:
    """The call is answered with an error naming the tool after tool_timeout_s, and the process then
    exits (a worker thread of a pool kept it alive forever, Ctrl-C or not)."""
    done = subprocess.run(
        [sys.executable, "-c", ONE_TURN, str(bad_tools_file), "0.5", call("stuck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == ["error: stuck did not return within 0.5 s"]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")
def test_ctrl_c_during_a_tool_call_stops_the_process(bad_tools_file) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", ONE_TURN, str(bad_tools_file), "3600", call("stuck")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "stuck: called\n"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode != 0 and "KeyboardInterrupt" in stderr


def test_a_tool_that_exits_or_raises_any_base_exception_is_a_failed_call(bad_tools_file) -> None:
    """sys.exit(0) in a tool ended the run with exit 0; a KeyboardInterrupt the tool raises itself (the
    user's Ctrl-C reaches the main thread, never a tool's) and any other BaseException are the tool's
    failure too. What cannot be written as a message (a circular value, a lone surrogate) likewise."""
    environment = ToolEnvironment.from_config(
        AgentConfig(environment="tools", tools=str(bad_tools_file), tool_timeout_s=5)
    )
    environment.reset(None)
    result = environment.step(
        call("leave") + call("interrupt") + call("odd") + call("circular") + call("surrogate")
    )
    assert [message["content"] for message in result.observation] == [
        "error: leave raised SystemExit: 0",
        "error: interrupt raised KeyboardInterrupt",
        "error: odd raised Odd: not an Exception",
        "error: circular returned a list that cannot be written as JSON (ValueError: Circular reference "
        "detected)",
        "error: surrogate returned text that is not UTF-8 (a lone surrogate '\\ud800' at character 5)",
    ]


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
    # What parsing can tell without running the file: a syntax error, a top-level import of a module
    # that is not installed, a relative import (the file is imported in no package).
    for source, problem in (
        ("def add(a, b)\n    return a + b\n", r"t\.py is not valid Python at line 1"),
        (
            "import json\nfrom not_installed_anywhere.sub import x\n\ndef add(a, b):\n    return a + b\n",
            r"t\.py imports 'not_installed_anywhere\.sub' at line 2, but no module 'not_installed_anywhere' is "
            r"installed for .*: install it there",
        ),
        (
            "from .helpers import x\n\ndef add(a, b):\n    return a + b\n",
            r"t\.py has a relative import at line 1",
        ),
    ):
        tools.write_text(source)
        with pytest.raises(ConfigError, match=rf"rollout\.agent\.tools: .*{problem}"):
            load_config([], [*base, "rollout.agent.environment=tools", f"rollout.agent.tools={tools}"])
    # An optional dependency (imported in a try block) is the file's business.
    tools.write_text(
        "try:\n    import not_installed_anywhere\nexcept ImportError:\n    pass\n\ndef add(a, b):\n    return a\n"
    )
    load_config([], [*base, "rollout.agent.environment=tools", f"rollout.agent.tools={tools}"])


@pytest.mark.parametrize("name", ["mcp", "openenv", "verifiers"])
def test_an_adapter_whose_package_is_missing_is_refused_naming_the_pip_command(monkeypatch, name) -> None:
    """The adapters' packages are extras: without one, selecting it is refused when the config loads,
    with the command that installs it (the package is never imported to list or check it)."""
    from verl_core.config import load_config
    from verl_core.errors import ConfigError
    from verl_core.plugins import Registry

    monkeypatch.setitem(sys.modules, name, None)  # what find_spec reads as not installed
    with pytest.raises(ConfigError) as error:
        load_config([], [f"rollout.agent.environment={name}"], registry=Registry.from_plugins(autoload=False))
    assert f'pip install "verl-core[{name}]"' in str(error.value)
    assert "rollout.agent.environment" in str(error.value)


@settings(max_examples=200, deadline=None)
@given(
    properties=st.dictionaries(st.text(max_size=8), st.just({"type": "string"}), max_size=5),
    required=st.data(),
)
def test_an_mcp_tools_input_schema_becomes_a_signature_that_binds_its_required_arguments(
    properties, required
) -> None:
    """Whatever a server's input schema names (keywords, names that are no identifiers, nothing), the
    tool's signature binds exactly the calls its schema allows: all required arguments given, none
    unknown; a schema it cannot spell as keywords takes any arguments (the server then answers)."""
    from verl_core.agents.adapters.mcp_tools import _signature

    needed = required.draw(st.sets(st.sampled_from(sorted(properties))) if properties else st.just(set()))
    signature = _signature({"type": "object", "properties": properties, "required": sorted(needed)})
    keywords = all(name.isidentifier() and not keyword.iskeyword(name) for name in properties)
    if not keywords:
        assert [p.kind for p in signature.parameters.values()] == [inspect.Parameter.VAR_KEYWORD]
        return
    signature.bind(**{name: "x" for name in needed})
    for missing in needed:
        with pytest.raises(TypeError):
            signature.bind(**{name: "x" for name in needed - {missing}})
    if "not_in_the_schema_" not in properties:
        with pytest.raises(TypeError):
            signature.bind(**{name: "x" for name in needed}, not_in_the_schema_=1)


def test_the_signature_check_can_fail() -> None:
    """A schema whose required argument is left out does not bind: the check above sees a refusal."""
    from verl_core.agents.adapters.mcp_tools import _signature

    signature = _signature({"properties": {"a": {}, "b": {}}, "required": ["a"]})
    signature.bind(a=1)
    with pytest.raises(TypeError):
        signature.bind(b=1)
