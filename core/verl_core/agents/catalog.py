"""Descriptors of core's built-in environments, by import string (no torch import here)."""

from __future__ import annotations

from verl_core.descriptors import Environment

ENVIRONMENTS: tuple[Environment, ...] = (
    Environment(
        name="tools",
        environment="verl_core.agents.environment:ToolEnvironment.from_config",
        description="runs the functions of rollout.agent.tools on the model's Hermes-style <tool_call> blocks",
    ),
    Environment(
        name="mcp",
        environment="verl_core.agents.environment:ToolEnvironment",
        description="the tools of an MCP server (rollout.agent.options: command or url) on <tool_call> blocks",
        start="verl_core.agents.adapters.mcp_tools:start",
        options="verl_core.agents.adapters.mcp_tools:MCPOptions",
        requires=("mcp",),
        install='pip install "verl-core[mcp]"',
    ),
    Environment(
        name="openenv",
        environment="verl_core.agents.adapters.openenv_server:OpenEnvEnvironment",
        description="an environment served by an OpenEnv server (rollout.agent.options.url), through openenv's client",
        start="verl_core.agents.adapters.openenv_server:start",
        options="verl_core.agents.adapters.openenv_server:OpenEnvOptions",
        requires=("openenv",),
        install='pip install "verl-core[openenv]"',
    ),
    Environment(
        name="verifiers",
        environment="verl_core.agents.adapters.verifiers_env:VerifiersConversation",
        description="a verifiers environment module (rollout.agent.options.env_id), its rubric as the reward",
        start="verl_core.agents.adapters.verifiers_env:start",
        options="verl_core.agents.adapters.verifiers_env:VerifiersOptions",
        requires=("verifiers",),
        install='pip install "verl-core[verifiers]"',
    ),
)
