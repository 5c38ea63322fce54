"""The ``mcp`` environment against a real MCP server (examples/mcp/serve_tools.py serving a tools
file with the ``mcp`` SDK's own server code) started by the tests on this machine: over stdio (a subprocess) and over
streamable HTTP on loopback. The server's answers are environment tokens (masked out of the loss), a
call past ``tool_timeout_s`` is answered with an error, GRPO trains with it in process, and a server
that exits at start, never answers or is down is a config error naming the key."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from fixtures.chat import build_chat_tokenizer, scripted_generate
from fixtures.demo import run_overrides
from fixtures.servers import chat_run_paths, free_port, serving, train_in_process

from verl_core.agents import AgentLoop, TurnTemplate
from verl_core.config import load_config
from verl_core.config.run import AgentConfig
from verl_core.data.batch import RESPONSE_MASK, RESPONSES
from verl_core.errors import ConfigError
from verl_core.rollout.base import SamplingParams

pytest.importorskip("mcp", reason='the mcp extra: pip install "verl-core[mcp]"')

from verl_core.agents.adapters.mcp_tools import MCPOptions, MCPTools  # noqa: E402

SERVER = Path(__file__).resolve().parents[1] / "examples" / "mcp" / "serve_tools.py"
#: The tools served: the calculator's, and one that outlives ``tool_timeout_s``.
TOOLS = Path(__file__).resolve().parent / "fixtures" / "mcp_tools.py"
STDIO = [sys.executable, str(SERVER), str(TOOLS)]
#: What a stdio server is given of this process's environment (the SDK passes on only HOME, PATH, ...):
#: where verl_core is imported from, when it is not installed.
ENV = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
TOKENIZER = build_chat_tokenizer()
EOS = TOKENIZER.eos_token_id
SAMPLING = SamplingParams(max_new_tokens=64, eos_token_ids=(EOS,), pad_token_id=TOKENIZER.pad_token_id)
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'


@pytest.fixture(scope="module")
def http_url(tmp_path_factory):
    """The calculator served over streamable HTTP on loopback, for the module's tests."""
    port = free_port()
    with serving([*STDIO, "--http", str(port)], port, tmp_path_factory.mktemp("server")):
        yield f"http://127.0.0.1:{port}/mcp"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_the_servers_answers_are_environment_tokens(request, transport) -> None:
    options = (
        MCPOptions(command=STDIO, env=ENV)
        if transport == "stdio"
        else MCPOptions(url=request.getfixturevalue("http_url"))
    )
    tools = MCPTools(options, timeout_s=10)
    try:
        assert sorted(tools.tools) == ["add", "multiply", "sleep"]
        loop = AgentLoop(
            TurnTemplate(TOKENIZER, (EOS,)), tools, AgentConfig(max_turns=2), response_length=200
        )
        replies = [[encode(CALL) + [EOS], encode("408") + [EOS]]]
        batch, (conversation,) = loop.run(scripted_generate(replies), [[5]], [None], [[]], SAMPLING, 0)
    finally:
        tools.close()
    assert conversation.messages[1] == {"role": "tool", "content": "408"}
    ids = batch[RESPONSES][0].tolist()
    from_model = batch[RESPONSE_MASK][0].tolist()
    environment_text = TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if not m])
    model_text = TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if m])
    assert "<|im_start|>tool\n408<|im_end|>" in environment_text  # the server's answer, masked out
    assert model_text == f"{CALL}<|im_end|>408<|im_end|>"  # the model's turns only, trained on


def test_a_call_past_tool_timeout_s_is_answered_with_an_error(http_url) -> None:
    tools = MCPTools(MCPOptions(url=http_url), timeout_s=0.5)
    try:
        environment = tools(AgentConfig())
        started = time.monotonic()
        result = environment.step('<tool_call>{"name": "sleep", "arguments": {"seconds": 5}}</tool_call>')
        assert time.monotonic() - started < 3
        assert result.observation[0]["content"] == "error: sleep did not return within 0.5 s"
        wrong = environment.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
        assert "missing a required argument: 'b'" in wrong.observation[0]["content"]
    finally:
        tools.close()


@pytest.mark.parametrize(
    ("options", "key", "problem"),
    [
        (
            {
                "command": [
                    sys.executable,
                    "-c",
                    "import sys; print('bad flag', file=sys.stderr); sys.exit(3)",
                ]
            },
            "rollout.agent.options.command",
            "failed at start (MCPError: Connection closed): check that it runs on its own; its stderr ends with: bad flag",
        ),
        (
            {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "startup_timeout_s": 1},
            "rollout.agent.options.command",
            "did not answer within 1 s: check that it speaks MCP over stdio",
        ),
        (
            {"url": "http://127.0.0.1:{port}/mcp"},
            "rollout.agent.options.url",
            "failed at start (ConnectError",
        ),
        ({}, "rollout.agent.options", "exactly one of command"),
    ],
)
def test_a_server_that_cannot_serve_is_a_config_error_naming_the_key(options, key, problem) -> None:
    if "url" in options:
        options = {"url": options["url"].format(port=free_port())}  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        MCPTools(MCPOptions(**options), timeout_s=1)
    ((where, message),) = error.value.errors
    assert where == key and problem in message
    assert time.monotonic() - started < 10  # the server is given up on, not waited for


def test_grpo_trains_with_the_tools_of_an_mcp_server(tmp_path) -> None:
    """Three GRPO steps in process on the tiny chat model, the stdio server started with the trainer and
    stopped at its shutdown; a wrong option is refused by the config's checks, naming the key."""
    from verl_core.trainer.rl import RLTrainer

    rows = [{"prompt": f"12 times {n}?", "ground_truth": str(12 * n)} for n in range(4)]
    paths = chat_run_paths(tmp_path, rows)
    settings = {
        "data.apply_chat_template": "true",
        "rollout.prompt_length": 32,
        "rollout.response_length": 24,
        "rollout.agent.environment": "mcp",
        "rollout.agent.options": json.dumps({"command": STDIO, "env": ENV}),
        "rollout.agent.max_turns": 2,
        "reward.function": "digits",
    }
    trainer, metrics = train_in_process(paths, tmp_path, settings)
    assert trainer.global_step == 3 and "agent/turns/mean" in metrics
    assert not trainer.agent_loop.environment_factory._background.thread.is_alive()  # closed at shutdown

    wrong = run_overrides(paths, tmp_path, **(settings | {"rollout.agent.options": '{"comand": [x]}'}))
    with pytest.raises(ConfigError, match=r"rollout\.agent\.options\.comand: unknown key"):
        RLTrainer.from_config(load_config([], wrong), show_progress=False)


def test_a_server_that_exits_at_start_is_refused_before_any_worker_starts(tmp_path, monkeypatch) -> None:
    from verl_core.trainer.rl import RLTrainer

    def no_workers(*args, **kwargs):
        raise AssertionError("the roles' workers were started")

    monkeypatch.setattr("verl_core.trainer.build.build_roles", no_workers)
    paths = chat_run_paths(tmp_path, [{"prompt": "1 + 1?", "ground_truth": "2"}] * 4)
    exits = [sys.executable, "-c", "import sys; sys.exit('no such table')"]
    settings = {"rollout.agent.environment": "mcp", "rollout.agent.options": json.dumps({"command": exits})}
    config = load_config(
        [], run_overrides(paths, tmp_path, **{"data.apply_chat_template": "true", **settings})
    )
    with pytest.raises(ConfigError) as error:
        RLTrainer.from_config(config, show_progress=False)
    ((key, message),) = error.value.errors
    assert key == "rollout.agent.options.command" and "its stderr ends with: no such table" in message
