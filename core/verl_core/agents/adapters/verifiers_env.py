"""The ``verifiers`` environment: an environment of PrimeIntellect's ``verifiers`` (its classic API, the
one the Environments Hub's modules implement: ``load_environment(env_id, **env_args)`` returning a
``vf.Environment``), run by its own rollout code, with its rubric as the reward.

verifiers drives a conversation itself: its ``rollout`` asks a model client for each reply
(``Client.get_response``), answers with its ``env_response``, and decides when the conversation is over
(its stop conditions, ``max_turns``). Here each conversation's rollout runs on a background event loop
with a model client of ours (``_bridge_client_class``) that calls no model: it hands the messages verifiers
would send to the agent loop and waits for the reply the loop's rollout sampled. ``step(model_text)``
gives it that reply and waits until verifiers either asks for the next one (the messages added since
are the observation) or ends the rollout, scored by the rubric (the reward). The loop keeps the
token-in/token-out contract: it generated the reply's ids, and the observation's messages are appended
as the chat template's ids, masked out of the loss.

``rollout.agent.options``: ``env_id`` (the module ``load_environment`` imports: ``owner/name`` or
``name``, dashes as underscores), ``env_args`` (its keyword arguments). The environment is loaded when
the trainer starts: a module that is not installed, or a ``load_environment`` that fails, is a
``ConfigError`` naming the key before the workers start. ``verifiers`` is imported only here
(``pip install "verl-core[verifiers]"``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
from typing import Any

import attrs

from verl_core.agents.adapters.background import BackgroundLoop
from verl_core.agents.environment import BaseEnvironment, StepResult
from verl_core.agents.tool_calls import parse_tool_calls
from verl_core.config.run import AgentConfig
from verl_core.config.validators import positive
from verl_core.errors import AgentError, ConfigError

#: Where the options are, for messages.
OPTIONS_KEY = "rollout.agent.options"
#: The model name verifiers records for the rollouts (it calls no model by it).
MODEL_NAME = "verl-core"
#: The verifiers releases whose classic API this adapter runs (0.4 dropped it).
SUPPORTED = ">=0.2,<0.4"
INSTALL = f'pip install "verifiers{SUPPORTED}"'


@attrs.define
class VerifiersOptions:
    """``rollout.agent.options`` of the ``verifiers`` environment."""

    #: The environment's module, as ``verifiers.load_environment`` takes it (``owner/name`` or ``name``).
    env_id: str
    #: Keyword arguments of the module's ``load_environment``.
    env_args: dict[str, Any] = attrs.field(factory=dict)
    #: Seconds verifiers may take between the model's reply and its next request (or the rollout's end,
    #: scoring included).
    timeout_s: float = attrs.field(default=120.0, validator=positive)


class VerifiersEnvironments:
    """The run's verifiers environment, loaded once, and the factory of each conversation's
    (``VerifiersConversation``). ``close()`` stops the event loop the rollouts run on."""

    def __init__(self, options: VerifiersOptions, max_turns: int):
        self.options = options
        self.environment = _load(options)
        # verifiers ends a conversation at its own max_turns; the loop at rollout.agent.max_turns: the
        # fewer of the two is the one both keep, so a conversation the loop ends is one verifiers scored.
        limit = getattr(self.environment, "max_turns", None)
        if isinstance(limit, int) and (limit <= 0 or limit > max_turns):
            self.environment.max_turns = max_turns
        self.background = BackgroundLoop("verl-core verifiers")

    def __call__(self, config: AgentConfig) -> VerifiersConversation:
        return VerifiersConversation(self)

    def close(self) -> None:
        self.background.stop()


class VerifiersConversation(BaseEnvironment):
    """One conversation: verifiers' rollout of the row, on the run's event loop, fed the loop's replies."""

    def __init__(self, environments: VerifiersEnvironments):
        self.environments = environments
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.client = _bridge_client_class()(self.events)
        self.rollout: Any = None
        self.pending: asyncio.Future[str] | None = None
        self.shown = 0  # messages of verifiers' conversation the loop has (prompt, then the turns)
        self.replies = 0  # the model's replies given to verifiers
        self.output: Any = None

    def reset(self, row: Any) -> None:
        rollout_input = _rollout_input(row)
        self.shown = len(rollout_input["prompt"]) if isinstance(rollout_input["prompt"], list) else 1
        environment = self.environments.environment

        async def run() -> None:
            try:
                output = await environment.run_rollout(rollout_input, self.client, MODEL_NAME, {})
            except BaseException as error:  # noqa: BLE001 - reported by the step that waits for it
                self.events.put(("error", error))
                raise
            self.events.put(("done", output))

        self.rollout = self.environments.background.submit(run())
        self._next()

    def step(self, model_text: str) -> StepResult:
        if self.pending is None:  # verifiers ended the rollout without asking for this reply
            return self._result()
        pending, self.pending = self.pending, None
        self.environments.background.loop.call_soon_threadsafe(_resolve, pending, model_text)
        self.shown += 1  # the reply, as the loop appended it
        self.replies += 1
        messages = self._next()
        if messages is None:
            return self._result()
        return StepResult(observation=[_chat_message(message) for message in messages])

    def _next(self) -> list[Any] | None:
        """Wait for verifiers' next request (the messages it adds to the conversation) or for the end of
        its rollout (``None``)."""
        timeout = self.environments.options.timeout_s
        try:
            kind, value = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AgentError(
                f"the verifiers environment {self.environments.options.env_id!r} neither asked for the next "
                f"reply nor ended the rollout within {OPTIONS_KEY}.timeout_s={timeout:g} s"
            ) from None
        if kind == "error":
            raise AgentError(
                f"the verifiers environment {self.environments.options.env_id!r} failed its rollout: "
                f"{type(value).__name__}: {value}"
            ) from value
        if kind == "done":
            self.output = value
            return None
        messages, self.pending = value
        # What the loop has must be the start of what verifiers sends, the loop's last reply included.
        if len(messages) < self.shown or (self.replies and _role(messages[self.shown - 1]) != "assistant"):
            raise AgentError(
                f"the verifiers environment {self.environments.options.env_id!r} asked for a reply to "
                f"{len(messages)} messages that do not continue the {self.shown} the loop has: an environment "
                "that rewrites the conversation (get_prompt_messages) cannot be run token in, token out"
            )
        added, self.shown = messages[self.shown :], len(messages)
        return added

    def _result(self) -> StepResult:
        error = self.output.get("error")
        if error:
            raise AgentError(
                f"the verifiers environment {self.environments.options.env_id!r} ended the rollout with an "
                f"error: {error}"
            )
        reward = self.output.get("reward")
        return StepResult(done=True, reward=None if reward is None else float(reward))

    def on_cut(self, reason: str) -> float | None:
        """The loop spent the response budget while verifiers waited for a reply: the reply is refused
        as verifiers' own clients refuse a prompt too long for the model (``OverlongPromptError``), so
        that verifiers ends the rollout its way (``prompt_too_long``, truncated) and scores it."""
        if self.pending is not None:
            import verifiers

            pending, self.pending = self.pending, None
            error = verifiers.OverlongPromptError(f"verl-core's agent loop ended the conversation ({reason})")
            self.environments.background.loop.call_soon_threadsafe(_refuse, pending, error)
            if self._next() is not None:
                raise AgentError(
                    f"the verifiers environment {self.environments.options.env_id!r} asked for another "
                    "reply after the conversation's response budget was spent"
                )
        return self._result().reward

    def close(self) -> None:
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()  # the run failed before verifiers ended this rollout


def _resolve(future: asyncio.Future[str], text: str) -> None:
    if not future.done():
        future.set_result(text)


def _refuse(future: asyncio.Future[str], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def _rollout_input(row: Any) -> dict[str, Any]:
    """verifiers' input for ``row``: its prompt (the messages, or a string as one user message) and its
    other columns (``answer``, ``info``, ``task``, ``example_id``: those of ``get_dataset()``)."""
    prompt = getattr(row, "prompt", None)
    if prompt is None:
        prompt = getattr(row, "prompt_text", "")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    extra = dict(getattr(row, "extra", {}) or {})
    extra.setdefault("example_id", 0)
    return {**extra, "prompt": [_plain(message) for message in prompt]}


def _plain(message: Any) -> dict[str, Any]:
    """A chat message as verifiers takes it: the keys that hold something (a dataset written to JSON
    lines fills every message with every key any has, ``null`` where it has none)."""
    return {key: value for key, value in dict(message).items() if value is not None}


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _chat_message(message: Any) -> dict[str, Any]:
    """One of verifiers' messages (a pydantic model, or a dict) as the loop's chat message."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones (the loop's templates take text)
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": message["role"], "content": "" if content is None else str(content)}


def _load(options: VerifiersOptions) -> Any:
    """``verifiers.load_environment(env_id, **env_args)``; a ``ConfigError`` naming the key when the
    module is not installed or fails to load."""
    import verifiers

    load = getattr(verifiers, "load_environment", None)
    if load is None:
        raise ConfigError(
            [
                (
                    "rollout.agent.environment",
                    f"verifiers {getattr(verifiers, '__version__', '?')} is installed, which has no classic "
                    f"load_environment(env_id) API: this adapter runs verifiers{SUPPORTED} ({INSTALL})",
                )
            ]
        )
    try:
        environment = load(options.env_id, **options.env_args)
    except Exception as error:  # noqa: BLE001 - verifiers wraps an import error in a ValueError
        cause = error.__cause__
        if isinstance(cause, ImportError) and _module_name(options.env_id) in str(cause):
            problem = (
                f"no verifiers environment {options.env_id!r} is installed (import "
                f"{_module_name(options.env_id)!r} failed): install it (prime env install OWNER/NAME, or pip "
                "install its package), or put its folder on PYTHONPATH"
            )
            raise ConfigError([(f"{OPTIONS_KEY}.env_id", problem)]) from None
        detail = f"{type(error).__name__}: {error}"
        raise ConfigError(
            [(f"{OPTIONS_KEY}.env_args", f"load_environment({options.env_id!r}) failed: {detail}")]
        ) from error
    if getattr(getattr(environment, "rubric", None), "has_group_rewards", False):
        raise ConfigError(
            [
                (
                    f"{OPTIONS_KEY}.env_id",
                    f"the verifiers environment {options.env_id!r} scores with group-level reward functions "
                    "(of all of a prompt's rollouts at once), which this adapter does not run: each "
                    "conversation is scored on its own",
                )
            ]
        )
    return environment


def _module_name(env_id: str) -> str:
    """The module ``load_environment`` imports for ``env_id``."""
    return env_id.replace("-", "_").split("/")[-1]


def start(config: AgentConfig, options: VerifiersOptions) -> VerifiersEnvironments:
    """The ``verifiers`` environment's ``start``: the environment ``options`` name, loaded."""
    return VerifiersEnvironments(options, config.max_turns)


@functools.cache
def _bridge_client_class() -> type:
    """The class of the conversations' model clients, made when first needed: its base is verifiers'
    ``Client``, and verifiers is imported only when the environment is used."""
    import verifiers

    class BridgeClient(verifiers.Client):
        """A verifiers model client that asks the agent loop: each request's messages go to ``events``
        with a future the loop's reply resolves."""

        def __init__(self, events: queue.Queue[tuple[str, Any]]):
            super().__init__(None)
            self.events = events

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> str:
            reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self.events.put(("request", (list(prompt), reply)))
            return await reply

        async def raise_from_native_response(self, response: str) -> None:
            return None

        async def from_native_response(self, response: str) -> Any:
            return _response(response)

        async def close(self) -> None:
            return None

    return BridgeClient


def _response(text: str) -> Any:
    """The reply's text as a verifiers ``Response``, its Hermes-style tool calls parsed (a ``ToolEnv``
    runs them)."""
    from verifiers.types import Response, ResponseMessage, ToolCall

    calls = [
        ToolCall(id=f"call_{number}", name=call.name, arguments=json.dumps(call.arguments))
        for number, call in enumerate(parse_tool_calls(text).calls)
    ]
    message = ResponseMessage(
        content=text,
        tool_calls=calls or None,
        finish_reason="tool_calls" if calls else "stop",
        is_truncated=False,
    )
    return Response(id="verl-core", created=0, model=MODEL_NAME, message=message)
