"""One configured MCP server over time: connected in the background, restarted when it fails.

Each server has a supervisor task that opens a connection (start the subprocess or reach the
URL, handshake, list tools), keeps it while it is healthy, and opens a new one when it ends:

- a server that is down at start-up is one warning line; its tools are absent and its calls fail
  at once while the supervisor retries with exponential backoff (``Backoff``), logging again only
  when the reason changes;
- a connection that ends (the server exited, wrote garbage, a call timed out) is reopened at once,
  and calls made meanwhile wait for it (up to the server's timeout), so the call after a crash
  goes to a fresh server; a server that keeps dying before answering a call backs off instead.

States: ``starting`` (first connection or a restart: calls wait), ``connected``, ``failed``
(retrying in the background: calls fail fast), ``disabled`` (``"disabled": true``), ``closed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from core.leases import before_side_effect
from core.metrics import MCP_TOOL_SECONDS
from core.redaction import Redactor
from core.tools.calls import canonical_json
from core.tools.config import Approval, ServerConfig, Transport
from core.tools.connection import Connection, root_cause, startup_seconds
from core.tools.outcome import OutcomeKind, ToolOutcome, render_content
from core.tools.stdio import MAX_MESSAGE_BYTES, TOO_LARGE_MARK
from core.tools.tool import McpTool, from_listing

if TYPE_CHECKING:
    from mcp import Client

log = logging.getLogger("slack-agent.mcp")

ServerState = Literal["starting", "connected", "failed", "disabled", "closed"]
MAX_LIST_PAGES = 100
# A connection that lived this long before it ended counts as healthy: it is restarted at once.
HEALTHY_SECONDS = 60.0
# How long shutdown lets a connection close by itself before cancelling its supervisor.
CLOSE_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class Backoff:
    """Delays between attempts to reach a server that is down: initial, doubled, capped."""

    initial: float = 1.0
    maximum: float = 60.0

    def delay(self, failures: int) -> float:
        return min(self.maximum, self.initial * 2.0 ** max(0, failures - 1))


@dataclass(frozen=True)
class ServerStatus:
    """A server as ``slack-agent tools`` shows it; ``tools`` are those offered now."""

    name: str
    transport: Transport
    target: str
    state: ServerState
    reason: str | None
    approval: Approval
    approvers: tuple[str, ...]
    tools: tuple[McpTool, ...]
    failed_attempts: int = 0  # attempts in a row that did not connect


class McpServer:
    def __init__(
        self,
        config: ServerConfig,
        redactor: Redactor,
        backoff: Backoff,
        on_change: Callable[[], None],
    ) -> None:
        self.config = config
        self.name = config.name
        self.redactor = redactor
        self.backoff = backoff
        self.state: ServerState = "disabled" if config.disabled else "starting"
        self.reason: str | None = "disabled in the configuration" if config.disabled else None
        self.tools: tuple[McpTool, ...] = ()  # offered: the last listing of the live connection
        self.known: dict[str, McpTool] = {}  # the last listing, kept while the server is down
        self._on_change = on_change
        self._conn: Connection | None = None  # the connection being opened or in use
        self._settled = asyncio.Event()  # set whenever the state is not "starting"
        self._first_attempt = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._connecting = False
        self._losses = 0  # connections lost in a row without a call answered
        self._failed_attempts = 0  # attempts in a row that did not connect
        if config.disabled:
            self._settled.set()
            self._first_attempt.set()

    def __repr__(self) -> str:
        return f"McpServer({self.config}, state={self.state})"

    def start(self) -> None:
        if self._task is None and not self.config.disabled:
            self._task = asyncio.create_task(self._supervise(), name=f"mcp-server:{self.name}")
            self._task.add_done_callback(self._supervisor_done)

    async def wait_first_attempt(self) -> None:
        await self._first_attempt.wait()

    def status(self) -> ServerStatus:
        c = self.config
        return ServerStatus(
            name=c.name,
            transport=c.transport,
            target=c.target,
            state=self.state,
            reason=self.reason,
            approval=c.approval,
            approvers=c.approvers,
            tools=self.tools,
            failed_attempts=self._failed_attempts,
        )

    async def aclose(self) -> None:
        task, self._task = self._task, None
        self._stop.set()
        if self._conn is not None:
            self._conn.end("shut down")
        if task is not None:
            if self._connecting:  # a handshake in progress could take the whole timeout
                task.cancel()
            done, _ = await asyncio.wait({task}, timeout=CLOSE_GRACE_SECONDS)
            if not done:
                task.cancel()
                await asyncio.wait({task})
        self._set_state("closed", "shut down")

    def _supervisor_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("MCP server %r: its supervisor stopped: %r", self.name, exc, exc_info=exc)
            self._set_state("failed", "stopped after an internal error (see the log)")

    # -- the supervisor -----------------------------------------------------------------------

    async def _supervise(self) -> None:
        try:
            await self._keep_connected()
        finally:
            self._conn = None

    async def _keep_connected(self) -> None:
        while not self._stop.is_set():
            conn = self._conn = Connection(self.config, self.redactor, self._ending)
            error: BaseException | None = None
            self._connecting = True
            try:
                async with conn.open() as client:
                    tools = await self._list_tools(client)
                    conn.client, conn.connected_at = client, time.monotonic()
                    self._connecting = False
                    self._connected(tools)
                    await conn.ended.wait()
            except Exception as exc:  # the reason is logged and shown; cancellation propagates
                error = exc
            finally:
                self._connecting = False
                conn.client = None
            if self._stop.is_set():
                break
            reason = await conn.describe(error)
            delay = (
                self._after_loss(conn, reason)
                if conn.connected_at is not None
                else self._after_fail(reason)
            )
            self._first_attempt.set()
            if delay:
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)

    def _ending(self) -> None:
        """A live connection is ending: calls from now on wait for the next one."""
        if self.state == "connected" and not self._stop.is_set():
            self._set_state("starting", "restarting")

    def _connected(self, tools: list[McpTool]) -> None:
        recovered = self.state == "failed" or not self._first_attempt.is_set()
        self.tools = tuple(tools)
        self.known = {tool.name: tool for tool in tools}
        self._failed_attempts = 0
        self._set_state("connected", None)
        self._first_attempt.set()
        if recovered:
            log.info("MCP server %r connected: %d tools offered", self.name, len(tools))

    def _after_loss(self, conn: Connection, reason: str) -> float:
        lived = time.monotonic() - (conn.connected_at or 0.0)
        self._losses = 1 if lived >= HEALTHY_SECONDS else self._losses + 1
        delay = 0.0 if self._losses == 1 else self.backoff.delay(self._losses - 1)
        log.warning(
            "MCP server %r %s; restarting%s", self.name, reason, f" in {delay:g} s" if delay else ""
        )
        self._set_state("starting" if delay == 0 else "failed", reason)
        return delay

    def _after_fail(self, reason: str) -> float:
        self._failed_attempts += 1
        delay = self.backoff.delay(self._failed_attempts)
        level = (
            logging.WARNING
            if reason != self.reason or self._failed_attempts == 1
            else logging.DEBUG
        )
        log.log(
            level,
            "MCP server %r is unavailable: %s; its tools are absent until it answers "
            "(next try in %g s)",
            self.name,
            reason,
            delay,
        )
        self._set_state("failed", reason)
        return delay

    def _set_state(self, state: ServerState, reason: str | None) -> None:
        self.state, self.reason = state, reason
        if state == "starting":
            self._settled.clear()
        else:
            self._settled.set()
        if state != "connected":
            self.tools = ()
        self._on_change()

    async def _list_tools(self, client: Client) -> list[McpTool]:
        listed: list[Any] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        wanted = self.config.tools
        if wanted is not None:
            missing = sorted(wanted - {t.name for t in listed})
            if missing:
                log.warning(
                    'MCP server %r does not offer %s, named in its "tools"',
                    self.name,
                    ", ".join(missing),
                )
            listed = [t for t in listed if t.name in wanted]
        tools: dict[str, McpTool] = {}
        for entry in listed:
            tool = from_listing(self.config, entry)
            if tool is None or tool.name in tools:
                log.warning(
                    "MCP server %r: tool %r is not offered (its name %s)",
                    self.name,
                    entry.name,
                    "is too long for the model" if tool is None else "collides with another's",
                )
                continue
            tools[tool.name] = tool
        return sorted(tools.values(), key=lambda t: t.name)

    # -- calls ----------------------------------------------------------------------------------

    async def call(self, tool: McpTool, arguments: dict[str, Any]) -> ToolOutcome:
        """Run one call on the live connection; every failure is an outcome naming the server."""
        if self.state == "starting":
            with suppress(TimeoutError):
                await asyncio.wait_for(self._settled.wait(), startup_seconds(self.config))
        conn = self._conn
        client = conn.client if conn is not None else None
        if self.state != "connected" or conn is None or client is None or conn.ended.is_set():
            return self._outcome(tool, "unavailable", self.unavailable())
        before_side_effect()  # a turn whose lease is no longer safely its own sends nothing
        started = time.monotonic()
        try:
            result = await client.call_tool(
                tool.tool, arguments, read_timeout_seconds=self.config.timeout_seconds
            )
        except Exception as exc:
            failed, text = await self._failure(conn, tool, exc)
            return self._outcome(tool, failed, text)
        finally:
            MCP_TOOL_SECONDS.labels(self.name).observe(time.monotonic() - started)
        self._losses = 0
        text, structured, truncated = render_content(result.content, result.structured_content)
        kind: OutcomeKind = "tool_error" if result.is_error else "ok"
        return self._outcome(tool, kind, text, structured, truncated)

    def unavailable(self) -> str:
        """Why a call cannot go to this server now, for the model."""
        name = f"MCP server {self.name!r}"
        if self.state == "starting":
            return f"{name} is still starting after {startup_seconds(self.config):g} s"
        if self.state == "failed":
            return f"{name} is unavailable: {self.reason} (retrying in the background)"
        if self.state == "disabled":
            return f"{name} is disabled in the configuration"
        return f"{name} is shut down"

    async def _failure(
        self, conn: Connection, tool: McpTool, exc: Exception
    ) -> tuple[OutcomeKind, str]:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        leaf = root_cause(exc)
        timeout = self.config.timeout_seconds
        if self._stop.is_set():
            return "unavailable", f"MCP server {self.name!r} was shut down during the call"
        if isinstance(leaf, MCPError) and _too_large(leaf.message):
            # The answer was dropped unparsed (core.tools.stdio, bounded_http); the server is
            # still connected and the model may ask for less.
            return "protocol_error", (
                f"MCP server {self.name!r} answered {tool.tool} with more than "
                f"{MAX_MESSAGE_BYTES:,} bytes, the most one answer may be; it was dropped "
                "unread (ask for less: a page, a filter, a summary)"
            )
        if isinstance(leaf, MCPError) and leaf.code == REQUEST_TIMEOUT:
            conn.end(f"did not answer a call within {timeout:g} s")
            return "timeout", (
                f"MCP server {self.name!r} did not answer {tool.tool} within {timeout:g} s; "
                "it is being restarted"
            )
        if isinstance(leaf, MCPError) and leaf.code == CONNECTION_CLOSED:
            conn.end(None)
            reason = await conn.describe()
            return "server_failed", (
                f"MCP server {self.name!r} {reason} during the call; it is being restarted"
            )
        if isinstance(leaf, MCPError):
            return "protocol_error", f"MCP server {self.name!r} refused the call: {leaf.message}"
        return "protocol_error", (
            f"MCP server {self.name!r} gave an answer that is not a valid tool result "
            f"({type(leaf).__name__}: {leaf})"
        )

    def _outcome(
        self,
        tool: McpTool,
        kind: OutcomeKind,
        text: str,
        structured: Any = None,
        truncated: bool = False,
    ) -> ToolOutcome:
        redact = self.redactor.redact
        if structured is not None and self.redactor.contains_secret(canonical_json(structured)):
            structured = None  # the text (redacted) still carries the result
        return ToolOutcome(tool.name, self.name, kind, redact(text), structured, truncated)


def _too_large(message: str) -> bool:
    """An error the transports made in place of an answer past the bound: ours, or the SDK's
    for an SSE event past ``max_sse_event_size`` (which we set to the same bound)."""
    return TOO_LARGE_MARK in message or ("Server-sent event exceeded the" in message)
