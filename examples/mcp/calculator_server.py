"""An MCP server with the calculator's tools (examples/tools/calculator.py), for the ``mcp``
environment (docs/agents.md, 'Tools of an MCP server'): ``python calculator_server.py`` speaks MCP over
stdio; ``python calculator_server.py --http PORT`` serves streamable HTTP on 127.0.0.1:PORT at ``/mcp``.

``sleep`` sleeps the seconds it is given: a tool that outlives ``rollout.agent.tool_timeout_s``."""

import argparse
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def multiply(a: int, b: int) -> int:
    """The product of two integers."""
    return a * b


@server.tool()
def add(a: int, b: int) -> int:
    """The sum of two integers."""
    return a + b


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep ``seconds``, then say so."""
    time.sleep(seconds)
    return f"slept {seconds} s"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on 127.0.0.1:PORT")
    port = parser.parse_args().http
    if port is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=port)
