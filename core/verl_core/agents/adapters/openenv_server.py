"""The ``openenv`` environment: an environment served by an OpenEnv server (``openenv-core``),
stepped through openenv's own client (``GenericEnvClient``: one WebSocket session per conversation).

``rollout.agent.options``: the server's ``url``; ``action_field``, the field of the environment's
action that gets the model's text; ``observation_field``, the field of its observation shown to the
model (by default every field but ``done``, ``reward`` and ``metadata``: a lone one as it is, several
as JSON), as a message of ``role``. The observation's ``reward`` replaces the reward function's score
and its ``done`` ends the conversation. The server is asked for its schema when the trainer starts: one
that is down, answers something other than an OpenEnv schema, or has no ``action_field`` is a
``ConfigError`` naming the key before the workers start. ``openenv`` is imported only here
(``pip install "verl-core[openenv]"``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

from verl_core.agents.adapters.background import BackgroundLoop
from verl_core.agents.environment import BaseEnvironment, StepResult
from verl_core.config.run import AgentConfig
from verl_core.config.validators import positive
from verl_core.errors import AgentError, ConfigError

#: Where the options are, for messages.
OPTIONS_KEY = "rollout.agent.options"
#: Observation fields that are the step's outcome, not what the model is shown.
OUTCOME_FIELDS = ("done", "reward", "metadata")


@attrs.define
class OpenEnvOptions:
    """``rollout.agent.options`` of the ``openenv`` environment."""

    #: The OpenEnv server (``http://127.0.0.1:8000``; its WebSocket is ``/ws`` below it).
    url: str
    #: The action's field that gets the model's text (the server's ``/schema`` lists the fields).
    action_field: str = "message"
    #: The observation's field shown to the model; ``None``: every field but done, reward and metadata.
    observation_field: str | None = None
    #: The role of the message the observation becomes (``user``: a simulated user or game; ``tool``).
    role: Literal["user", "tool"] = "user"
    #: Seconds the server may take to connect, or to answer one message.
    timeout_s: float = attrs.field(default=60.0, validator=positive)


class OpenEnvServer:
    """The run's OpenEnv server, checked against its schema, and the factory of each conversation's
    environment (``OpenEnvEnvironment``). ``close()`` stops the client's event loop."""

    def __init__(self, options: OpenEnvOptions):
        self.options = options
        self.schema = _schema(options)
        self.background = BackgroundLoop("verl-core openenv")

    def __call__(self, config: AgentConfig) -> OpenEnvEnvironment:
        return OpenEnvEnvironment(self)

    def run(self, coroutine: Any) -> Any:
        return self.background.run(coroutine, self.options.timeout_s)

    def close(self) -> None:
        self.background.stop()


class OpenEnvEnvironment(BaseEnvironment):
    """One conversation: one session of the server, ``reset`` at the start, a ``step`` per model turn."""

    def __init__(self, server: OpenEnvServer):
        from openenv.core import GenericEnvClient

        self.server = server
        options = server.options
        self.client = GenericEnvClient(
            base_url=options.url, connect_timeout_s=options.timeout_s, message_timeout_s=options.timeout_s
        )

    def reset(self, row: Any) -> None:
        try:
            self.server.run(self.client.reset())
        except Exception as error:
            raise AgentError(
                f"the OpenEnv server at {self.server.options.url} did not start a session "
                f"({type(error).__name__}: {error}): a step's conversations (data.train_batch_size x rollout.n) "
                "each hold one at once, so the server must allow as many (create_app(max_concurrent_envs=...))"
            ) from error

    def step(self, model_text: str) -> StepResult:
        options = self.server.options
        try:
            result = self.server.run(self.client.step({options.action_field: model_text}))
        except Exception as error:
            raise AgentError(
                f"the OpenEnv server at {options.url} failed a step: {type(error).__name__}: {error}"
            ) from error
        reward = None if result.reward is None else float(result.reward)
        if result.done:
            return StepResult(done=True, reward=reward)
        return StepResult(
            observation={"role": options.role, "content": self.shown(result.observation)}, reward=reward
        )

    def shown(self, observation: Any) -> str:
        """The text of ``observation`` the model is shown (``observation_field``, or its fields)."""
        field = self.server.options.observation_field
        if not isinstance(observation, dict):
            raise AgentError(
                f"the OpenEnv server answered an observation {observation!r:.200} that is no object"
            )
        if field is not None:
            if field not in observation:
                raise AgentError(
                    f"{OPTIONS_KEY}.observation_field={field!r}: the server's observation has no such field "
                    f"(it has {', '.join(sorted(observation))})"
                )
            value = observation[field]
        else:
            shown = {key: value for key, value in observation.items() if key not in OUTCOME_FIELDS}
            value = next(iter(shown.values())) if len(shown) == 1 else shown
        return value if isinstance(value, str) else json.dumps(value, default=str)

    def close(self) -> None:
        self.server.run(self.client.disconnect())


def start(config: AgentConfig, options: OpenEnvOptions) -> OpenEnvServer:
    """The ``openenv`` environment's ``start``: the server ``options`` name, checked."""
    return OpenEnvServer(options)


def _schema(options: OpenEnvOptions) -> dict[str, Any]:
    """The server's ``/schema``; a ``ConfigError`` naming the key when it is down, answers something
    else, or its action has no ``action_field``."""
    import requests

    url = options.url.rstrip("/") + "/schema"
    try:
        response = requests.get(url, timeout=options.timeout_s)
        response.raise_for_status()
        schema = response.json()
    except requests.ConnectionError as error:
        raise ConfigError(
            [
                (
                    f"{OPTIONS_KEY}.url",
                    f"no OpenEnv server answers at {options.url} ({type(error).__name__}): start it, or fix the URL",
                )
            ]
        ) from None
    except Exception as error:  # noqa: BLE001 - an HTTP error, a body that is not JSON, a timeout
        raise ConfigError(
            [
                (
                    f"{OPTIONS_KEY}.url",
                    f"{options.url} does not answer as an OpenEnv server (GET /schema: {type(error).__name__}: {error})",
                )
            ]
        ) from None
    action = schema.get("action") if isinstance(schema, dict) else None
    fields = action.get("properties") if isinstance(action, dict) else None
    if not isinstance(fields, dict):
        raise ConfigError(
            [
                (
                    f"{OPTIONS_KEY}.url",
                    f"{options.url} does not answer as an OpenEnv server (GET /schema returned {str(schema)[:200]!r}, no action schema)",
                )
            ]
        )
    if options.action_field not in fields:
        raise ConfigError(
            [
                (
                    f"{OPTIONS_KEY}.action_field",
                    f"{options.action_field!r} is no field of the server's action; its fields are {', '.join(sorted(fields))}",
                )
            ]
        )
    return schema
