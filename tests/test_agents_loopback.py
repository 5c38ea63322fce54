"""Nothing of a run with the adapters' environments reaches beyond loopback: the trainer (one GRPO step
with each of ``mcp`` over stdio, ``mcp`` over streamable HTTP and ``openenv``), the MCP server it starts
and the servers the test starts all run with the socket spy of tests/test_everyday_faults.py, which
records every socket call naming another address, and every address looked up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.demo import run_overrides
from fixtures.servers import chat_run_paths, free_port, serving
from fixtures.sockets import describe, install_spy, recorded, run_script, spied_environment

pytest.importorskip("mcp", reason='the mcp extra: pip install "verl-core[mcp]"')
pytest.importorskip("openenv", reason='the openenv extra: pip install "verl-core[openenv]"')

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MCP_SERVER = [
    sys.executable,
    str(EXAMPLES / "mcp" / "serve_tools.py"),
    str(EXAMPLES / "tools" / "calculator.py"),
]
OPENENV_SERVER = [sys.executable, str(EXAMPLES / "openenv" / "echo_server.py")]
#: What the spy needs in a process's environment (an MCP stdio server inherits only what it is given).
SPY_VARIABLES = ("PYTHONPATH", "VERL_TEST_SOCKET_LOG")
#: Trains each list of overrides of argv[1] in process, one step each.
TRAIN = """
import json, sys
from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer

for overrides in json.loads(sys.argv[1]):
    trainer = RLTrainer.from_config(load_config([], overrides), show_progress=False)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
"""


def test_the_adapters_reach_nothing_beyond_loopback(tmp_path) -> None:
    env, log = spied_environment(tmp_path)
    paths = chat_run_paths(tmp_path, [{"prompt": f"say {n}", "ground_truth": str(n)} for n in range(4)])
    common = {
        "data.apply_chat_template": "true",
        "rollout.prompt_length": 32,
        "rollout.response_length": 24,
        "rollout.agent.max_turns": 2,
        "rollout.agent.max_tokens_per_turn": 8,
        "trainer.total_training_steps": 1,
    }
    mcp_port, openenv_port = free_port(), free_port()
    options = {
        "mcp-stdio": ("mcp", {"command": MCP_SERVER, "env": {key: env[key] for key in SPY_VARIABLES}}),
        "mcp-http": ("mcp", {"url": f"http://127.0.0.1:{mcp_port}/mcp"}),
        "openenv": ("openenv", {"url": f"http://localhost:{openenv_port}", "observation_field": "echoed"}),
    }
    runs = [
        run_overrides(
            paths,
            tmp_path / name,
            **common,
            **{"rollout.agent.environment": environment, "rollout.agent.options": json.dumps(given)},
        )
        for name, (environment, given) in options.items()
    ]
    with (
        serving([*MCP_SERVER, "--http", str(mcp_port)], mcp_port, tmp_path, env=env),
        serving([*OPENENV_SERVER, str(openenv_port)], openenv_port, tmp_path, env=env),
    ):
        run_script(TRAIN, json.dumps(runs), env=env)
    started, calls = recorded(log)
    commands = [line["argv"] for line in started]
    # The calculator served over HTTP, and started over stdio by the trainer; OpenEnv's server; the trainer.
    assert sum("serve_tools.py" in argv for argv in commands) == 2
    assert any("echo_server.py" in argv for argv in commands) and any(
        argv.startswith("-c ") for argv in commands
    )
    assert not calls, "a process reached beyond loopback:\n" + describe(calls)


def test_the_spy_sees_what_leaves_loopback(tmp_path) -> None:
    """The check above can fail: a lookup of a public name is recorded (and fails here: no network)."""
    log = tmp_path / "sockets.jsonl"
    spy = install_spy(tmp_path / "spy")
    env = {**os.environ, "PYTHONPATH": str(spy), "VERL_TEST_SOCKET_LOG": str(log)}
    probe = "import socket\ntry:\n    socket.getaddrinfo('example.org', 443)\nexcept OSError:\n    pass"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=60)
    _, calls = recorded(log)
    assert [call["address"] for call in calls] == ["('example.org',)"]
