"""The agent loop as the RL trainer uses it: built from ``rollout.agent`` (or ``None`` when off), and
run over a step's prompts, ``n`` conversations each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from verl_core.agents.loop import AgentLoop, Generate
from verl_core.agents.template import TurnTemplate
from verl_core.config.run import RunConfig
from verl_core.data.batch import ATTENTION_MASK, ENVIRONMENT_REWARDS, RESPONSE_MASK, RESPONSES
from verl_core.hookspecs import Kind
from verl_core.rollout.base import SamplingParams

#: The config key that selects the environment, for messages.
ENVIRONMENT_KEY = "rollout.agent.environment"


def build_agent_loop(
    config: RunConfig, tokenizer: Any, sampling: SamplingParams, registry: Any = None
) -> AgentLoop | None:
    """The agent loop ``rollout.agent`` describes; ``None`` for single-turn rollouts (no environment).
    The environment is looked up in the registry (errors name the key) and the chat template checked
    now, before the first step."""
    agent = config.rollout.agent
    if agent.environment is None:
        return None
    from verl_core.plugins.registry import registry_or_installed

    entry = registry_or_installed(registry).entry(Kind.ENVIRONMENTS, agent.environment, where=ENVIRONMENT_KEY)
    factory = entry.load("environment")
    template = TurnTemplate(tokenizer, sampling.eos_token_ids)
    return AgentLoop(template, factory, agent, config.rollout.response_length)


def prompt_messages(row: Any) -> list[dict[str, Any]]:
    """What the template renders before the first reply. The dataset keeps the rendered prompt, not its
    messages: it stands in as one user message (the ids appended after it depend only on the turns
    around them for the templates multi-turn rollouts accept)."""
    return [{"role": "user", "content": row.prompt_text}]


def run_conversations(
    loop: AgentLoop, generate: Generate, rows: Sequence[Any], n: int, sampling: SamplingParams, seed: int
) -> TensorDict:
    """``n`` conversations per row, in row order, as one batch with ``ENVIRONMENT_REWARDS``."""
    repeated = [row for row in rows for _ in range(n)]
    batch, conversations = loop.run(
        generate,
        [row.prompt_ids for row in repeated],
        repeated,
        [prompt_messages(row) for row in repeated],
        sampling,
        seed,
    )
    batch[ENVIRONMENT_REWARDS] = torch.tensor(
        [float("nan") if c.reward is None else float(c.reward) for c in conversations]
    )
    return batch


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
