"""Environments: what answers the model between its turns (tools, a game, a simulated user).

An environment is made once per conversation by its factory (an ``Environment`` descriptor's
``environment``, called with the ``rollout.agent`` config), told which dataset row it serves with
``reset(row)``, and then answers each model turn with ``step(model_text) -> StepResult``: the
messages to append (a tool result, a user turn), whether the conversation is over, and optionally
the reward (which then replaces the reward function's score for that response).

Core's built-in ``tools`` environment (``ToolEnvironment``) runs plain Python functions from a
user's file on the model's Hermes-style tool calls.
"""

from __future__ import annotations

import abc
import inspect
import json
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from verl_core.agents.tool_calls import LONE_SURROGATE, parse_tool_calls
from verl_core.config.run import AgentConfig
from verl_core.errors import AgentError
from verl_core.reward.loading import import_user_file

#: The config key naming the tools file, for messages.
TOOLS_KEY = "rollout.agent.tools"
#: Prefix of the module names tools files are imported under.
TOOLS_MODULE_PREFIX = "verl_core_tools_file_"


def _as_messages(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # a plain string is the environment's answer as a tool message
        return ({"role": "tool", "content": value},)
    if isinstance(value, Mapping):
        value = [value]
    messages = tuple(dict(message) for message in value)
    for message in messages:
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise AgentError(
                f"an environment's observation {message!r:.80} is not a chat message: return a string, "
                'or messages {"role": "tool" | "user", "content": ...}'
            )
    return messages


@attrs.frozen
class StepResult:
    """An environment's answer to one model turn.

    ``observation``: the messages to append before the model's next turn (a string is one ``tool``
    message; ``None`` or ``()``: nothing); ``done``: the conversation is over (the observation is then
    not appended); ``reward``: the response's score, replacing the reward function's (``None``: the
    reward function scores it).
    """

    observation: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=_as_messages)
    done: bool = False
    reward: float | None = None


class BaseEnvironment(abc.ABC):
    """Base class of environments (see the module docstring)."""

    def reset(self, row: Any) -> None:  # noqa: B027 - most environments need no per-row state
        """Start a conversation for ``row`` (a ``verl_core.data.PromptRow``: ``prompt_text``,
        ``extra`` with the row's other columns)."""

    @abc.abstractmethod
    def step(self, model_text: str) -> StepResult:
        """Answer the model's latest turn (its text, the end-of-turn token left out)."""

    def on_cut(self, reason: str) -> float | None:
        """The loop ended the conversation before the environment did (``reason``, as
        ``Conversation.cut``: ``max_turns``, or ``response_length``: the response budget is spent); the
        conversation's reward as it stands, replacing any a step gave, or ``None`` to keep that (the
        reward function scores a conversation that has none). Called once, after the last step."""
        return None

    def close(self) -> None:  # noqa: B027 - most environments hold nothing to release
        """Release what the conversation holds (a session on a server); called once when the step's
        conversations are over, however they ended."""


# -- tools -----------------------------------------------------------------------------------------


class ToolEnvironment(BaseEnvironment):
    """Runs the model's ``<tool_call>`` blocks (``verl_core.agents.tool_calls``) on ``tools`` (name ->
    function called with the call's arguments as keywords); each call's result, or what went wrong,
    comes back as one ``tool`` message. A reply without any tool call ends the conversation: it is
    the final answer, which the reward function scores.

    A call that raises (``SystemExit`` and ``KeyboardInterrupt`` included: the user's Ctrl-C reaches
    the main thread, never a tool's), has unknown or wrong arguments, runs longer than ``timeout_s`` or
    returns what cannot be written as text is answered with an error message naming the tool. Each call
    runs in a daemon thread of its own, so that a call that never returns holds neither the run nor
    the exit of the process (it keeps running until it returns or the process ends: write tools that
    return).
    """

    def __init__(self, tools: Mapping[str, Callable[..., Any]], timeout_s: float = 10.0):
        self.tools = dict(tools)
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, config: AgentConfig) -> ToolEnvironment:
        if not config.tools:
            raise AgentError(
                f"rollout.agent.environment=tools needs {TOOLS_KEY}: a .py file whose functions are the tools"
            )
        return cls(load_tools(config.tools), timeout_s=config.tool_timeout_s)

    def step(self, model_text: str) -> StepResult:
        parsed = parse_tool_calls(model_text)
        if not parsed.has_calls:
            return StepResult(done=True)
        answers = [f"error: {problem}" for problem in parsed.problems]
        answers += [self.call(call.name, call.arguments) for call in parsed.calls]
        return StepResult(observation=[{"role": "tool", "content": answer} for answer in answers])

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """One tool call's result as text (JSON for what is not a string), or ``error: ...``."""
        function = self.tools.get(name)
        if function is None:
            return f"error: there is no tool {name!r}; the tools are {', '.join(sorted(self.tools))}"
        try:
            inspect.signature(function).bind(**arguments)
        except TypeError as error:
            return f"error: {name}{inspect.signature(function)} cannot take {_shown(arguments)}: {error}"
        except ValueError:  # no signature (some builtins): the call itself will tell
            pass
        call = _ToolCall(name, function, arguments)
        call.start()
        call.join(self.timeout_s)
        if call.is_alive():
            return f"error: {name} did not return within {self.timeout_s:g} s"
        if call.error is not None:
            return f"error: {name} raised {_describe(call.error)}"
        return _result_text(name, call.result)


class _ToolCall(threading.Thread):
    """One tool call in a daemon thread: its result, or whatever it raised (any ``BaseException``: a
    ``sys.exit()`` in a tool is the tool's failure, not the end of the run)."""

    def __init__(self, name: str, function: Callable[..., Any], arguments: dict[str, Any]):
        super().__init__(name=f"verl-core tool {name}", daemon=True)
        self.function, self.arguments = function, arguments
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.function(**self.arguments)
        except BaseException as error:  # noqa: BLE001 - reported to the model as the tool's failure
            self.error = error


def _shown(value: Any, limit: int = 200) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - nested too deeply to show (RecursionError)
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - an exception whose message cannot be made
        text = "(its message cannot be shown)"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _result_text(name: str, result: Any) -> str:
    """A tool's result as the text of its message: a string as it is, anything else as JSON, or an
    error naming what cannot be written (the chat template and the tokenizer take UTF-8 text only)."""
    try:
        text = result if isinstance(result, str) else json.dumps(result, default=str)
    except Exception as error:  # noqa: BLE001 - a circular or too deep value, a str() that raises
        return f"error: {name} returned a {type(result).__name__} that cannot be written as JSON ({_describe(error)})"
    surrogate = LONE_SURROGATE.search(text)
    if surrogate:
        return (
            f"error: {name} returned text that is not UTF-8 (a lone surrogate {surrogate.group()!r} at "
            f"character {surrogate.start()})"
        )
    return text


def load_tools(path: str | Path) -> dict[str, Callable[..., Any]]:
    """The tools of a ``.py`` file: its public functions defined in the file itself, by name. The file
    is imported from its path under a module name of its own (never through ``sys.path``)."""
    path = Path(path).expanduser()
    if path.suffix != ".py" or not path.is_file():
        raise AgentError(
            f"{TOOLS_KEY}={str(path)!r}: there is no .py file there (relative paths are relative to the "
            f"working directory, {Path.cwd()}); name a Python file whose functions are the tools"
        )
    module = import_user_file(path, TOOLS_MODULE_PREFIX, f"{TOOLS_KEY}={str(path)!r}", AgentError)
    tools = {
        name: value
        for name, value in vars(module).items()
        if inspect.isfunction(value) and not name.startswith("_") and value.__module__ == module.__name__
    }
    if not tools:
        raise AgentError(f"{TOOLS_KEY}={str(path)!r} defines no public function: define the tools in it")
    return tools


def make_environments(factory: Callable[..., Any], config: AgentConfig, rows: Sequence[Any]) -> list[Any]:
    """One environment per row, each ``reset`` to its row; a factory that returns something without
    ``step`` is refused here, naming it."""
    environments: list[Any] = []
    try:
        for row in rows:
            environment = factory(config)
            if not callable(getattr(environment, "step", None)):
                raise AgentError(
                    f"the environment factory {getattr(factory, '__qualname__', factory)!r} returned "
                    f"{type(environment).__name__}, which has no step(model_text) method: return a "
                    "verl_core.agents.BaseEnvironment"
                )
            environments.append(environment)
            environment.reset(row)
    except BaseException:  # the ones made so far hold what they hold (a session on a server)
        close_environments(environments)
        raise
    return environments


def close_environments(environments: Sequence[Any]) -> None:
    """``close()`` every environment that has one; one that raises is warned about, naming it, and the
    others are still closed (the step's result is kept: nothing is left to answer)."""
    for environment in environments:
        close = getattr(environment, "close", None)
        if not callable(close):
            continue
        try:
            close()
        except Exception as error:  # noqa: BLE001 - a release that fails must not lose the step
            warnings.warn(
                f"closing the environment {type(environment).__name__} raised {_describe(error)}",
                RuntimeWarning,
                stacklevel=2,
            )
