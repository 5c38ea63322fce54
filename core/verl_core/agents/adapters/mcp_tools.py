"""The ``mcp`` environment: the tools of an MCP server (the ``mcp`` Python SDK's client), offered to
the model in the Hermes tool-call format of ``verl_core.agents.tool_calls`` and run by core's
``ToolEnvironment``, so each call is bounded by ``rollout.agent.tool_timeout_s`` and whatever goes
wrong in it comes back to the model as an ``error: ...`` message.

``rollout.agent.options`` names the server: ``command`` (a command line started as a subprocess,
spoken to over its stdin/stdout) or ``url`` (a streamable HTTP endpoint). One connection serves every
conversation of the run; it is opened when the trainer starts, so a server that exits at start, or
never answers, is a ``ConfigError`` at that key before the workers start. The ``mcp`` package is
imported only here (``pip install "verl-core[mcp]"``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import keyword
import tempfile
from typing import Any

import attrs

from verl_core.agents.adapters.background import BackgroundLoop
from verl_core.agents.environment import ToolEnvironment
from verl_core.config.run import AgentConfig
from verl_core.config.validators import positive
from verl_core.errors import ConfigError

#: Where the options are, for messages.
OPTIONS_KEY = "rollout.agent.options"
#: The most of a failed server's stderr a message shows.
STDERR_TAIL = 1000
#: Seconds ``close()`` waits for the connection to end (a stdio server to stop).
CLOSE_TIMEOUT_S = 10.0


@attrs.define
class MCPOptions:
    """``rollout.agent.options`` of the ``mcp`` environment: the server, by exactly one of ``command``
    and ``url``."""

    #: The server's command line, started as a subprocess and spoken to over stdio
    #: (``[python, my_server.py]``).
    command: list[str] | None = None
    #: The server's streamable HTTP endpoint (``http://127.0.0.1:8000/mcp``).
    url: str | None = None
    #: Environment variables of a ``command`` server, on top of the few the MCP SDK passes on (``HOME``,
    #: ``PATH``, ...: the trainer's environment is not inherited).
    env: dict[str, str] = attrs.field(factory=dict)
    #: Seconds the server may take to start and answer the handshake and the tools' listing.
    startup_timeout_s: float = attrs.field(default=30.0, validator=positive)


class MCPTools:
    """The run's connection to an MCP server, and the factory of each conversation's environment
    (a ``ToolEnvironment`` over the server's tools). ``close()`` ends the connection (and stops a
    stdio server)."""

    def __init__(self, options: MCPOptions, timeout_s: float):
        self.options = options
        self.timeout_s = timeout_s
        self.where, self.server = _server(options)
        self._stderr = tempfile.TemporaryFile(mode="w+", prefix="verl-core-mcp-")
        self._background = BackgroundLoop("verl-core mcp")
        self._stop: Any = None
        self._task: Any = None
        self._client: Any = None
        try:
            listed = self._connect()
        except BaseException:
            self.close()
            raise
        self.tools = {tool.name: self._tool(tool) for tool in listed}

    def __call__(self, config: AgentConfig) -> ToolEnvironment:
        return ToolEnvironment(self.tools, timeout_s=self.timeout_s)

    def _connect(self) -> list[Any]:
        import asyncio

        ready: asyncio.Future[list[Any]] = self._background.loop.create_future()
        self._background.submit(self._hold(ready))
        timeout_s = self.options.startup_timeout_s

        async def listed() -> list[Any]:
            return await ready

        try:
            return self._background.run(listed(), timeout_s)
        except TimeoutError:
            problem = (
                f"did not answer within {timeout_s:g} s: check that it speaks MCP over {self.server}, or "
                f"raise {OPTIONS_KEY}.startup_timeout_s"
            )
        except Exception as error:  # noqa: BLE001 - whatever the SDK raises, said with the server's stderr
            problem = f"failed at start ({_described(error)}): check that it runs on its own"
        raise ConfigError(
            [(self.where, f"the MCP server {self.server_text()} {problem}{self._stderr_tail()}")]
        )

    async def _hold(self, ready: Any) -> None:
        """Open the client, list the tools (``ready``), and keep the connection until ``close()``: the
        SDK's client must be entered and left in one task."""
        import asyncio

        import mcp

        self._stop = asyncio.Event()
        self._task = asyncio.current_task()
        try:
            async with mcp.Client(self._transport()) as client:
                self._client = client
                ready.set_result(list((await client.list_tools()).tools))
                await self._stop.wait()
        except BaseException as error:
            if not ready.done():
                ready.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))
            raise

    async def _finish(self) -> None:
        """Leave the client in its task (a server still starting is given up on), which stops a stdio
        server."""
        import asyncio

        if self._client is None:
            self._task.cancel()
        else:
            self._stop.set()
        await asyncio.wait([self._task], timeout=CLOSE_TIMEOUT_S)

    def _transport(self) -> Any:
        if self.options.url is not None:
            return self.options.url
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        command, *args = self.options.command or []
        parameters = StdioServerParameters(command=command, args=args, env=self.options.env or None)
        return stdio_client(parameters, errlog=self._stderr)

    def _tool(self, tool: Any) -> Any:
        """A function calling ``tool`` on the server, with the signature its input schema gives (so
        that ``ToolEnvironment`` answers wrong arguments before calling)."""
        name = tool.name

        def call(**arguments: Any) -> str:
            result = self._background.run(self._client.call_tool(name, arguments), self.timeout_s + 1)
            text = "\n".join(_block_text(block) for block in result.content)
            return f"error: {name} failed: {text}" if getattr(result, "is_error", False) else text

        call.__name__ = call.__qualname__ = name
        call.__doc__ = tool.description
        call.__signature__ = _signature(getattr(tool, "input_schema", None))  # type: ignore[attr-defined]
        return call

    def server_text(self) -> str:
        return (
            repr(self.options.url)
            if self.options.url is not None
            else repr(" ".join(self.options.command or []))
        )

    def _stderr_tail(self) -> str:
        with contextlib.suppress(Exception):
            self._stderr.seek(0)
            text = self._stderr.read().strip()
            if text:
                return f"; its stderr ends with: {text[-STDERR_TAIL:]}"
        return ""

    def close(self) -> None:
        """End the connection (a stdio server is stopped) and the background loop."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                self._background.run(self._finish(), CLOSE_TIMEOUT_S + 1)
        self._background.stop()
        self._stderr.close()


def start(config: AgentConfig, options: MCPOptions) -> MCPTools:
    """The ``mcp`` environment's ``start``: connect to the server ``options`` name."""
    return MCPTools(options, config.tool_timeout_s)


def _server(options: MCPOptions) -> tuple[str, str]:
    """The key naming the server, and how; a ``ConfigError`` unless exactly one is given."""
    if (options.command is None) == (options.url is None):
        raise ConfigError(
            [
                (
                    OPTIONS_KEY,
                    "name the MCP server by exactly one of command (a command line, spoken to over stdio: "
                    "[python, my_server.py]) and url (streamable HTTP: http://127.0.0.1:8000/mcp)",
                )
            ]
        )
    if options.command is not None:
        if not options.command:
            raise ConfigError([(f"{OPTIONS_KEY}.command", "is empty: give the server's command line")])
        return f"{OPTIONS_KEY}.command", "stdio"
    if not str(options.url).startswith(("http://", "https://")):
        raise ConfigError([(f"{OPTIONS_KEY}.url", f"{options.url!r} is not an http(s) URL")])
    return f"{OPTIONS_KEY}.url", "streamable HTTP"


def _signature(schema: Any) -> inspect.Signature:
    """Keyword-only parameters for the properties of a JSON input schema (required ones without a
    default); ``**arguments`` when the schema cannot be read that way."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    keywords = isinstance(properties, dict) and all(
        isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) for name in properties
    )
    if not keywords:  # no schema, or a property Python cannot name (``class``, ``a-b``, ``""``)
        return inspect.Signature([inspect.Parameter("arguments", inspect.Parameter.VAR_KEYWORD)])
    required = set(schema.get("required") or ())
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=inspect.Parameter.empty if name in required else None,
            )
            for name in properties
        ]
    )


def _block_text(block: Any) -> str:
    text = getattr(block, "text", None)
    if isinstance(text, str):
        return text
    dump = getattr(block, "model_dump", None)
    return json.dumps(dump(mode="json") if callable(dump) else str(block), default=str)


def _described(error: BaseException) -> str:
    while len(getattr(error, "exceptions", ())) == 1:  # an exception group of the SDK's task group
        error = error.exceptions[0]  # type: ignore[attr-defined]
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


__all__ = ["MCPOptions", "MCPTools", "start"]
