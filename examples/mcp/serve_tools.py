"""Serve the tools of a tools file (every public function defined in it, as the ``tools`` environment
takes them: docs/agents.md) as an MCP server, with the ``mcp`` SDK's own server code:

    python examples/mcp/serve_tools.py examples/tools/calculator.py               # over stdio
    python examples/mcp/serve_tools.py examples/tools/calculator.py --http 8000   # http://127.0.0.1:8000/mcp

so that ``rollout.agent.environment: mcp`` can serve the same tools from another process or machine."""

import argparse

from mcp.server.mcpserver import MCPServer

from verl_core.agents import load_tools

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("tools", help="a .py file whose public functions are the tools")
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    arguments = parser.parse_args()
    server = MCPServer("verl-core tools")
    for function in load_tools(arguments.tools).values():
        server.tool()(function)
    if arguments.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=arguments.http)
