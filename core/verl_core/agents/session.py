"""The agent loop as the RL trainer uses it: built from ``rollout.agent`` (or ``None`` when off), and
run over a step's prompts, ``n`` conversations each."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from verl_core.agents.loop import (
    CUT_MAX_TURNS,
    CUT_RESPONSE_LENGTH,
    AgentLoop,
    Conversation,
    Generate,
    Submit,
)
from verl_core.agents.template import TurnTemplate
from verl_core.config.run import AgentConfig, RunConfig
from verl_core.data.batch import ATTENTION_MASK, ENVIRONMENT_REWARDS, RESPONSE_MASK, RESPONSES
from verl_core.errors import AgentError, ConfigError
from verl_core.hookspecs import Kind
from verl_core.reward.loading import import_problem
from verl_core.rollout.base import SamplingParams

#: The config key that selects the environment, for messages.
ENVIRONMENT_KEY = "rollout.agent.environment"
#: The config key of the environment's own options, for messages.
OPTIONS_KEY = "rollout.agent.options"
#: Core's environment that runs the functions of ``rollout.agent.tools``.
TOOLS_ENVIRONMENT = "tools"
#: Model turns per conversation: the mean and the most over a step's conversations.
TURNS_MEAN_KEY = "agent/turns/mean"
TURNS_MAX_KEY = "agent/turns/max"
#: The share of a step's conversations that ``rollout.agent.max_turns`` ended while the environment went
#: on, and that the response budget (``rollout.response_length``) ended (``Conversation.cut``).
CUT_MAX_TURNS_KEY = "agent/cut/max_turns"
CUT_RESPONSE_LENGTH_KEY = "agent/cut/response_length"


def build_agent_loop(
    config: RunConfig, tokenizer: Any, sampling: SamplingParams, registry: Any = None, factory: Any = None
) -> AgentLoop | None:
    """The agent loop ``rollout.agent`` describes; ``None`` for single-turn rollouts (no environment).
    The environment is looked up in the registry (errors name the key) and started
    (``start_environment``) unless its ``factory`` is given, and the chat template checked now, before
    the first step."""
    agent = config.rollout.agent
    if agent.environment is None:
        return None
    template = TurnTemplate(tokenizer, sampling.eos_token_ids)
    if factory is None:
        factory = start_environment(config, registry)
    return AgentLoop(template, factory, agent, config.rollout.response_length)


def start_environment(config: RunConfig, registry: Any = None) -> Any:
    """The factory of each conversation's environment (``None`` for single-turn rollouts): the
    descriptor's ``environment``, or what its ``start`` returns, called now with the checked options
    (an adapter connects to its server: one that cannot serve is a ``ConfigError`` naming the key)."""
    agent = config.rollout.agent
    if agent.environment is None:
        return None
    from verl_core.plugins.registry import registry_or_installed

    entry = registry_or_installed(registry).entry(Kind.ENVIRONMENTS, agent.environment, where=ENVIRONMENT_KEY)
    options = environment_options(entry, agent)
    if entry.descriptor.start is None:
        return entry.load("environment")
    return entry.load("start")(agent, options)  # one connection for the run


def environment_options(entry: Any, agent: AgentConfig) -> Any:
    """``rollout.agent.options`` structured into the options class of the environment's descriptor
    (``None`` when it names none); a ``ConfigError`` naming each key that is wrong, or the options of
    an environment that takes none."""
    if entry.descriptor.options is None:
        if agent.options:
            raise ConfigError(
                [(OPTIONS_KEY, f"the environment '{agent.environment}' takes no options: remove the key")]
            )
        return None
    from verl_core.config.convert import structure

    return structure(agent.options, entry.load("options"), OPTIONS_KEY)


def close_environment_factory(factory: Any) -> None:
    """Close the run's connection of an environment that has one (its ``start``'s factory with a
    ``close()``: a server subprocess stopped, a connection closed); nothing for others."""
    if isinstance(factory, type):  # a class: its close() is each conversation's
        return
    close = getattr(factory, "close", None)
    if callable(close):
        close()


def import_tools_file(agent: AgentConfig) -> None:
    """Import the ``tools`` environment's file (``rollout.agent.tools``) now, before any worker starts:
    one that fails on import is a ``ConfigError`` at that key naming the file, the line and the cause.

    The run imports the file in this process anyway, as it does a reward file (docs/rewards.md: loading
    a file runs it); ``verl-core config`` and the config's load only parse it."""
    if agent.environment != TOOLS_ENVIRONMENT or agent.tools is None:
        return
    from verl_core.agents.environment import TOOLS_KEY, load_tools

    try:
        load_tools(agent.tools)
    except AgentError as error:
        cause = error.__cause__
        problem = str(error) if cause is None else import_problem(Path(agent.tools).expanduser(), cause)
        raise ConfigError(
            [(TOOLS_KEY, f"{problem}: fix the file, which runs when the run starts")]
        ) from cause


def prompt_messages(row: Any) -> list[dict[str, Any]]:
    """What the template renders before the first reply. The dataset keeps the rendered prompt, not its
    messages: it stands in as one user message (the ids appended after it depend only on the turns
    around them for the templates multi-turn rollouts accept)."""
    return [{"role": "user", "content": row.prompt_text}]


def run_conversations(
    loop: AgentLoop, generate: Generate, rows: Sequence[Any], n: int, sampling: SamplingParams, seed: int
) -> tuple[TensorDict, list[Conversation]]:
    """``n`` conversations per row, in row order, turn by turn (``AgentLoop.run``): one batch with
    ``ENVIRONMENT_REWARDS``, and the conversations (for ``conversation_metrics``)."""
    return _with_rewards(*loop.run(generate, *_inputs(rows, n), sampling, seed))


async def request_conversations(
    loop: AgentLoop, submit: Submit, rows: Sequence[Any], n: int, sampling: SamplingParams, seed: int
) -> tuple[TensorDict, list[Conversation]]:
    """``run_conversations``'s result, each conversation sending its own requests to ``submit``
    (``AgentLoop.run_requests``)."""
    return _with_rewards(*await loop.run_requests(submit, *_inputs(rows, n), sampling, seed))


def _inputs(rows: Sequence[Any], n: int) -> tuple[list[Any], list[Any], list[list[dict[str, Any]]]]:
    """The prompts, rows and prompt messages of ``n`` conversations per row."""
    repeated = [row for row in rows for _ in range(n)]
    return [row.prompt_ids for row in repeated], repeated, [prompt_messages(row) for row in repeated]


def _with_rewards(
    batch: TensorDict, conversations: list[Conversation]
) -> tuple[TensorDict, list[Conversation]]:
    batch[ENVIRONMENT_REWARDS] = torch.tensor(
        [float("nan") if c.reward is None else float(c.reward) for c in conversations]
    )
    return batch, conversations


def conversation_metrics(conversations: Sequence[Conversation]) -> dict[str, float]:
    """A step's multi-turn metrics (docs/training.md): model turns per conversation (mean, max) and the
    share of conversations cut by ``rollout.agent.max_turns`` and by ``rollout.response_length``."""
    count = len(conversations)
    turns = [conversation.turns for conversation in conversations]
    cut = [conversation.cut for conversation in conversations]
    return {
        TURNS_MEAN_KEY: sum(turns) / count,
        TURNS_MAX_KEY: float(max(turns)),
        CUT_MAX_TURNS_KEY: cut.count(CUT_MAX_TURNS) / count,
        CUT_RESPONSE_LENGTH_KEY: cut.count(CUT_RESPONSE_LENGTH) / count,
    }


def turns(tokenizer: Any, batch: TensorDict, row: int) -> list[dict[str, str]]:
    """Response ``row`` of ``batch`` as its turns, for sample logs: each run of model tokens
    (``{"model": text}``) and of environment tokens (``{"environment": text}``, the template's turn
    boundaries with the environment's messages), decoded with special tokens kept."""
    width = batch[RESPONSES].shape[-1]
    length = int(batch[ATTENTION_MASK][row, -width:].sum())
    ids = batch[RESPONSES][row, :length].tolist()
    from_model = batch[RESPONSE_MASK][row, :length].tolist()
    runs: list[dict[str, str]] = []
    start = 0
    for end in range(1, length + 1):
        if end == length or from_model[end] != from_model[start]:
            source = "model" if from_model[start] else "environment"
            runs.append({source: tokenizer.decode(ids[start:end], skip_special_tokens=False)})
            start = end
    return runs
