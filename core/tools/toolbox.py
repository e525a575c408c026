"""The MCP tools the agent loop offers and calls: one object over every configured server.

The loop's part, per model round and per tool call::

    tools = McpTools(load_mcp_config(settings.mcp_config))  # ConfigError: one line, stop
    await tools.start()                        # at start-up; returns at once
    specs = [SHELL, *tools.specs()]            # what connected servers offer now
    ...
    if tools.needs_approval(call.name) and tools.precheck(call.name, call.arguments) is None:
        ...  # the approval flow: ask a person, keep tools.tool(call.name).digest(call.arguments)
    else:
        outcome = await tools.call(call.name, call.arguments)
    ...
    outcome = await tools.call(name, arguments, approval=digest)  # once a person approved
    await tools.aclose()                       # at shutdown

``call`` never raises (except ``CancelledError``): an unknown name, arguments that break the
schema, a server that is down, dies, hangs or refuses, and a call that needs an approval it does
not carry are all outcomes the model reads. The approval check happens inside ``call`` against the
tool's rule at that moment, so a server restarting with other annotations cannot slip an
unapproved change through, and the approval is the digest of the exact call, so it cannot be
spent on different arguments.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Any

from core.metrics import MCP_SERVER_CONNECTED, MCP_TOOL_CALLS
from core.providers.base import ToolSpec
from core.tools.config import McpConfig
from core.tools.names import server_of
from core.tools.outcome import ToolOutcome
from core.tools.secrets import WATCHED_LOGGERS, RedactingFilter
from core.tools.server import Backoff, McpServer, ServerState, ServerStatus
from core.tools.tool import McpTool

UNKNOWN = "(unknown)"
log = logging.getLogger("slack-agent.mcp")


class McpTools:
    def __init__(self, config: McpConfig, *, backoff: Backoff | None = None) -> None:
        self.config = config
        self.redactor = config.redactor
        self._servers = {
            s.name: McpServer(s, config.redactor, backoff or Backoff(), self._changed)
            for s in config.servers
        }
        self._offered: dict[str, McpTool] = {}
        self._known: dict[str, McpTool] = {}
        self._change = asyncio.Event()
        self._filter = RedactingFilter(config.redactor)
        self._started = False
        self._closed = False

    def __repr__(self) -> str:
        return f"McpTools({', '.join(map(repr, self._servers.values())) or 'no servers'})"

    async def __aenter__(self) -> McpTools:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start every enabled server in the background: never waits for one, never fails."""
        if self._started:
            return
        self._started = True
        if self.redactor:
            for name in WATCHED_LOGGERS:
                logging.getLogger(name).addFilter(self._filter)
        for server in self._servers.values():
            server.start()

    async def wait_ready(self) -> None:
        """Until every server has had its first attempt (connected or failed); each attempt is
        bounded by its server's timeout, and a caller in a hurry wraps this in a timeout."""
        await asyncio.gather(*(s.wait_first_attempt() for s in self._servers.values()))

    async def wait_for(self, server: str, state: ServerState) -> None:
        """Until ``server`` is in ``state`` (tests and the demo bound it with a timeout)."""
        while self._servers[server].state != state:
            await self._change.wait()

    async def changed(self) -> None:
        """Until the next change of any server's state or tools."""
        await self._change.wait()

    async def aclose(self) -> None:
        """Close every session and stop every subprocess; the tools are gone afterwards."""
        self._closed = True
        await asyncio.gather(*(s.aclose() for s in self._servers.values()))
        for name in WATCHED_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)

    def _changed(self) -> None:
        offered: dict[str, McpTool] = {}
        known: dict[str, McpTool] = {}
        for server in self._servers.values():
            known.update(server.known)
            offered.update({t.name: t for t in server.tools})
            MCP_SERVER_CONNECTED.labels(server.name).set(1 if server.state == "connected" else 0)
        self._offered, self._known = offered, known
        self._change.set()
        self._change = asyncio.Event()

    # -- what the model is offered --------------------------------------------------------------

    def specs(self) -> list[ToolSpec]:
        """The tools of the servers connected now, in a stable order."""
        return [tool.spec() for tool in self._offered.values()]

    def tool(self, name: str) -> McpTool | None:
        """The tool of that name from its server's last listing (kept while the server is down)."""
        return self._known.get(name)

    def needs_approval(self, name: str) -> bool:
        """Whether a call of ``name`` needs a person's decision first. False for a name no
        server lists: ``call`` refuses it without running anything."""
        tool = self._known.get(name)
        return tool is not None and tool.needs_approval

    def approvers(self, name: str) -> tuple[str, ...]:
        """Who may decide a call of ``name`` besides the session's owner and the admins."""
        tool = self._known.get(name)
        if tool is not None:
            return tool.approvers
        server = self._servers.get(server_of(name) or "")
        return server.config.approvers if server is not None else ()

    def status(self) -> list[ServerStatus]:
        return [server.status() for server in self._servers.values()]

    # -- calls ------------------------------------------------------------------------------------

    def precheck(self, name: str, arguments: Any) -> ToolOutcome | None:
        """The outcome ``call`` would give without contacting a server (an unknown name,
        arguments that break the schema), or None. Counts nothing: pass such a call to
        ``call``, which returns the same outcome and counts it."""
        tool = self._known.get(name)
        if tool is None:
            return self._unknown(name)
        problem = tool.check.problem(arguments)
        if problem is not None:
            text = f"the arguments do not match the input schema of {name}: {problem}"
            return ToolOutcome(name, tool.server, "invalid_arguments", self.redactor.redact(text))
        return None

    async def call(self, name: str, arguments: Any, *, approval: str | None = None) -> ToolOutcome:
        """Run one call. ``approval`` is the ``McpTool.digest`` a person approved, needed when the
        tool's rule asks for approval; any other value (or none) refuses the call unrun."""
        outcome: ToolOutcome | None = self.precheck(name, arguments)
        tool = self._known.get(name)
        try:
            if outcome is None and tool is not None:
                outcome = await self._run(tool, arguments, approval)
        except asyncio.CancelledError:
            MCP_TOOL_CALLS.labels(tool.server if tool else UNKNOWN, _label(tool), "cancelled").inc()
            raise
        except Exception as exc:  # a bug of ours must not crash the turn either
            assert tool is not None
            log.exception("MCP call %s failed unexpectedly", name)
            text = (
                f"the call to MCP server {tool.server!r} failed unexpectedly ({type(exc).__name__})"
            )
            outcome = ToolOutcome(name, tool.server, "protocol_error", text)
        assert outcome is not None
        server = outcome.server or UNKNOWN
        MCP_TOOL_CALLS.labels(server, _label(tool), outcome.kind).inc()
        return outcome

    async def _run(
        self, tool: McpTool, arguments: dict[str, Any], approval: str | None
    ) -> ToolOutcome:
        if tool.needs_approval and approval != tool.digest(arguments):
            text = (
                f"{tool.name} may change something outside this conversation, so it runs only "
                "once a person approves this exact call; it was not run"
            )
            return ToolOutcome(tool.name, tool.server, "approval_required", text)
        server = self._servers[tool.server]
        if self._closed:
            text = f"MCP server {tool.server!r} is shut down"
            return ToolOutcome(tool.name, tool.server, "unavailable", text)
        return await server.call(tool, arguments)

    def _unknown(self, name: str) -> ToolOutcome:
        server = self._servers.get(server_of(name) or "")
        if server is not None and server.state != "connected":
            text = self.redactor.redact(server.unavailable())
            return ToolOutcome(name, server.name, "unavailable", text)
        offered = ", ".join(self._offered) or "none"
        text = f"no MCP server offers a tool named {name!r} (offered now: {offered})"
        return ToolOutcome(name, None, "unknown_tool", text[:2000])


def _label(tool: McpTool | None) -> str:
    """The metrics' tool label: only names a server listed, so a model cannot mint labels."""
    return tool.tool if tool is not None else UNKNOWN
