"""Environments from outside standards, each an optional extra imported only when it is selected:
``openenv`` (an OpenEnv server, stepped through openenv's client), ``mcp`` (the tools of an MCP
server, offered in the Hermes tool-call format of ``verl_core.agents.tool_calls``) and ``verifiers`` (a
verifiers environment module, run by its own rollout code). docs/agents.md has
a section on each; their descriptors are in ``verl_core.agents.catalog``."""
