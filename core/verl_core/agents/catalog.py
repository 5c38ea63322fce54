"""Descriptors of core's built-in environments, by import string (no torch import here)."""

from __future__ import annotations

from verl_core.descriptors import Environment

ENVIRONMENTS: tuple[Environment, ...] = (
    Environment(
        name="tools",
        environment="verl_core.agents.environment:ToolEnvironment.from_config",
        description="runs the functions of rollout.agent.tools on the model's Hermes-style <tool_call> blocks",
    ),
)
