"""Multi-turn rollouts: the agent loop, environments and tools (docs/agents.md).

The loop (``loop``) grows each conversation token in / token out: the model's sampled ids as they
are, the environment's messages as the ids the chat template adds for them (``template``), with
``response_mask`` 1 on the model's tokens only. Environments are a plugin kind (hook
``verl_environments``); core's built-in ``tools`` (``environment``) runs plain Python functions on
Hermes-style tool calls (``tool_calls``). Imports are lazy: listing plugins imports no torch.
"""

from verl_core.lazy import lazy_exports

_EXPORTS = {
    "AgentLoop": "verl_core.agents.loop",
    "Conversation": "verl_core.agents.loop",
    "BaseEnvironment": "verl_core.agents.environment",
    "StepResult": "verl_core.agents.environment",
    "ToolEnvironment": "verl_core.agents.environment",
    "load_tools": "verl_core.agents.environment",
    "ParsedReply": "verl_core.agents.tool_calls",
    "ToolCall": "verl_core.agents.tool_calls",
    "parse_tool_calls": "verl_core.agents.tool_calls",
    "TurnTemplate": "verl_core.agents.template",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
