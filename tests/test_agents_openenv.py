"""The ``openenv`` environment against a real OpenEnv server (examples/openenv/echo_server.py, served by
openenv-core's own server code on loopback, one per module), stepped through openenv's client: its
observations are environment tokens (masked out of the loss) and its reward the responses' score; GRPO
trains with it in process; a server that is down or answers garbage is a config error naming the key."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

import pytest
from fixtures.chat import build_chat_tokenizer, scripted_generate
from fixtures.servers import chat_run_paths, free_port, serving, train_in_process

from verl_core.agents import AgentLoop, TurnTemplate
from verl_core.config.run import AgentConfig
from verl_core.data.batch import RESPONSE_MASK, RESPONSES
from verl_core.errors import ConfigError
from verl_core.rollout.base import SamplingParams

pytest.importorskip("openenv", reason='the openenv extra: pip install "verl-core[openenv]"')

from verl_core.agents.adapters.openenv_server import OpenEnvOptions, OpenEnvServer  # noqa: E402

SERVER = Path(__file__).resolve().parents[1] / "examples" / "openenv" / "echo_server.py"
TOKENIZER = build_chat_tokenizer()
EOS = TOKENIZER.eos_token_id
SAMPLING = SamplingParams(max_new_tokens=64, eos_token_ids=(EOS,), pad_token_id=TOKENIZER.pad_token_id)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The echo environment served by openenv on loopback, for the module's tests."""
    port = free_port()
    with serving([sys.executable, str(SERVER), str(port)], port, tmp_path_factory.mktemp("server")):
        yield f"http://127.0.0.1:{port}"


def test_observations_are_environment_tokens_and_the_reward_scores(url) -> None:
    server = OpenEnvServer(OpenEnvOptions(url=url, observation_field="echoed"))
    try:
        loop = AgentLoop(
            TurnTemplate(TOKENIZER, (EOS,)), server, AgentConfig(max_turns=3), response_length=200
        )
        replies = [[TOKENIZER.encode("hello") + [EOS], TOKENIZER.encode("hi there, echo") + [EOS]]] * 2
        batch, conversations = loop.run(
            scripted_generate(replies), [[5], [6]], [None, None], [[], []], SAMPLING, 0
        )
    finally:
        server.close()
    for row, conversation in enumerate(conversations):
        assert conversation.messages[1] == {"role": "user", "content": "hello"}
        assert conversation.reward == 1.0  # the second (last) step's: 14 characters, done
        ids, from_model = batch[RESPONSES][row].tolist(), batch[RESPONSE_MASK][row].tolist()
        environment = TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if not m])
        assert "<|im_start|>user\nhello<|im_end|>" in environment  # the server's echo, masked out
        assert TOKENIZER.decode([i for i, m in zip(ids, from_model, strict=True) if m]) == (
            "hello<|im_end|>hi there, echo<|im_end|>"
        )


class Garbage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        body = b"<html>not an environment</html>" if self.path == "/schema" else b"{}"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("case", "key", "problem"),
    [
        ("down", "rollout.agent.options.url", "no OpenEnv server answers at"),
        (
            "garbage",
            "rollout.agent.options.url",
            "does not answer as an OpenEnv server (GET /schema: JSONDecodeError",
        ),
        (
            "field",
            "rollout.agent.options.action_field",
            "'text' is no field of the server's action; its fields are",
        ),
    ],
)
def test_a_server_that_is_down_or_answers_garbage_is_a_config_error_naming_the_key(
    url, case, key, problem
) -> None:
    garbage = None
    if case == "down":
        options = OpenEnvOptions(url=f"http://127.0.0.1:{free_port()}", timeout_s=5)
    elif case == "garbage":
        garbage = http.server.HTTPServer(("127.0.0.1", 0), Garbage)
        threading.Thread(target=garbage.serve_forever, daemon=True).start()
        options = OpenEnvOptions(url=f"http://127.0.0.1:{garbage.server_port}", timeout_s=5)
    else:
        options = OpenEnvOptions(url=url, action_field="text")
    try:
        with pytest.raises(ConfigError) as error:
            OpenEnvServer(options)
    finally:
        if garbage is not None:
            garbage.shutdown()
    ((where, message),) = error.value.errors
    assert where == key and problem in message, message


def test_grpo_trains_on_an_openenv_environment(tmp_path, url) -> None:
    """Three GRPO steps in process on the tiny chat model, every conversation a session of the server."""
    paths = chat_run_paths(tmp_path, [{"prompt": f"say {n}", "ground_truth": str(n)} for n in range(4)])
    settings = {
        "data.apply_chat_template": "true",
        "rollout.prompt_length": 32,
        "rollout.response_length": 40,
        "rollout.agent.environment": "openenv",
        "rollout.agent.options": json.dumps({"url": url, "observation_field": "echoed"}),
        "rollout.agent.max_turns": 3,
        "rollout.agent.max_tokens_per_turn": 6,
        "reward.function": "exact_match",
    }
    trainer, metrics = train_in_process(paths, tmp_path, settings)
    assert trainer.global_step == 3
    batch = trainer.last_batch
    width = batch[RESPONSES].shape[1]
    environment = batch["attention_mask"][:, -width:].bool() & ~batch[RESPONSE_MASK].bool()
    assert environment.any()  # the server's echoes (a conversation the model ended with an EOS has none)
    assert not batch["advantages"][environment].any()
    assert 0 < metrics["reward/mean"] <= 1  # the server's reward, not exact_match's 0
