"""One live connection to an MCP server: its transport, its SDK client, and why it ended.

A connection is opened and closed by its server's supervisor task only (the SDK's task groups
must be left by the task that entered them); calls from turns use its client concurrently.
It watches what the transport delivers, because the SDK by itself would leave a call waiting
when the server dies quietly or writes something that is not JSON-RPC to stdout: either ends
the connection at once, its in-flight calls fail with the reason, and the supervisor restarts it.

A stdio server's stderr goes through a pipe we read: each line reaches our log at debug level
(redacted), and the last ones explain a server that exits ("exited: no such notes file").
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from importlib.metadata import PackageNotFoundError, version
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from core.redaction import Redactor
from core.tools.config import ServerConfig
from core.tools.stdio import MAX_MESSAGE_BYTES, MessageTooLarge, bounded_stdio_client

if TYPE_CHECKING:
    from mcp import Client
    from mcp.client._transport import ReadStream, TransportStreams
    from mcp.shared.message import SessionMessage

log = logging.getLogger("slack-agent.mcp")

STDERR_LINES_KEPT = 20
PR_SET_DUMPABLE = 4  # linux/prctl.h
# The handshake and tool listing may take this long even under a short call timeout: a server
# started through a package runner (npx, uvx) may install itself first.
MIN_STARTUP_SECONDS = 30.0
MAX_REASON_CHARS = 300
# How long a failure's description waits for the exited server's last stderr line.
STDERR_SETTLE_SECONDS = 1.0

try:
    _VERSION = version("slack-agent")
except PackageNotFoundError:  # running from a source tree that was never installed
    _VERSION = "0"


class Connection:
    def __init__(
        self, config: ServerConfig, redactor: Redactor, on_end: Callable[[], None] = lambda: None
    ) -> None:
        self.config = config
        self.redactor = redactor
        self._on_end = on_end
        self.client: Client | None = None
        self.ended = asyncio.Event()
        self.end_reason: str | None = None
        self.connected_at: float | None = None
        self._stderr: StderrTail | None = None

    def end(self, reason: str | None) -> None:
        """Ask the supervisor to close this connection; the first reason given is kept."""
        if not self.ended.is_set():
            self.end_reason = reason
            self.ended.set()
            self._on_end()

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Client]:
        """The SDK client, handshake done ("auto": the 2026 discovery, else ``initialize``)."""
        from mcp import Client
        from mcp_types import Implementation

        client = Client(
            self._transport(),
            mode="auto",
            read_timeout_seconds=startup_seconds(self.config),
            cache=None,  # a restarted server may list other tools: always ask it
            client_info=Implementation(name="slack-agent", version=_VERSION),
        )
        async with client:
            yield client

    def _transport(self) -> Any:
        return self._stdio() if self.config.transport == "stdio" else self._http()

    @asynccontextmanager
    async def _stdio(self) -> AsyncIterator[TransportStreams]:
        from mcp.client.stdio import StdioServerParameters

        launch = self.config.launch
        hide_from_children()
        # A directory of its own unless the file names one: the app's directory holds .env.
        own = None if launch.cwd else tempfile.mkdtemp(prefix="slack-agent-mcp-")
        # Only its declared environment over the SDK's safe defaults (PATH, HOME, USER, ...):
        # never the app's, which holds the Slack token and the database URL.
        params = StdioServerParameters(
            command=launch.command, args=list(launch.args), env=launch.env, cwd=launch.cwd or own
        )
        tail = self._stderr = StderrTail(self.config.name, self.redactor)
        try:
            await tail.start()
            async with bounded_stdio_client(params, tail.writer) as (read, write):
                tail.writer.close()  # the server holds its own copy; EOF comes when it exits
                yield _WatchedRead(read, self, "exited"), write
        finally:
            await tail.aclose()
            if own is not None:
                shutil.rmtree(own, ignore_errors=True)

    @asynccontextmanager
    async def _http(self) -> AsyncIterator[TransportStreams]:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        from core.tools.bounded_http import bound_responses

        launch, timeout = self.config.launch, self.config.timeout_seconds
        # A call's SSE answer may be silent for the whole of the server's timeout.
        limits = httpx2.Timeout(min(30.0, timeout), read=max(300.0, timeout + 5))
        # What one answer may weigh, as over stdio: an SSE event (the SDK's own bound, set to
        # ours) or a JSON body (``bound_responses``), before anything parses it.
        hooks = {"response": [bound_responses(MAX_MESSAGE_BYTES)]}
        async with (
            httpx2.AsyncClient(headers=launch.headers, timeout=limits, event_hooks=hooks) as http,
            streamable_http_client(
                launch.url, http_client=http, max_sse_event_size=MAX_MESSAGE_BYTES
            ) as (read, write),
        ):
            yield _WatchedRead(read, self, "closed the connection"), write

    async def describe(self, exc: BaseException | None = None) -> str:
        """Why this connection failed or ended, in one redacted line (``exc``: what was raised)."""
        reason = self.end_reason
        if reason is None and exc is not None:
            reason = self._reason_of(root_cause(exc))
        reason = reason or "closed the connection"
        # An exited server's last words say why; a live one's are unrelated to the failure.
        if self._stderr is not None and (reason == "exited" or self.connected_at is None):
            line = await self._stderr.last_line()
            if line and line not in reason:
                reason = f"{reason} ({line})"
        return _one_line(self.redactor.redact(reason))

    def _reason_of(self, exc: BaseException) -> str:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        if isinstance(exc, MCPError):
            if exc.code == CONNECTION_CLOSED:
                return "exited" if self.config.transport == "stdio" else "closed the connection"
            if exc.code == REQUEST_TIMEOUT:
                return f"did not answer within {startup_seconds(self.config):g} s"
            return f"answered with an error: {exc.message}"
        if isinstance(exc, OSError) and self.config.transport == "stdio":
            return f"cannot be started ({exc.strerror or exc})"
        if type(exc).__module__.split(".")[0] in ("httpx2", "httpcore2"):
            detail = f"{type(exc).__name__}: {exc or 'no detail'}"
            if "Connect" in type(exc).__name__:
                return f"cannot be reached ({detail})"
            return f"broke the HTTP exchange ({detail})"
        return f"failed ({type(exc).__name__}: {exc})"


def startup_seconds(config: ServerConfig) -> float:
    """How long connecting (handshake, tool listing) may take; calls have ``timeout_seconds``."""
    return max(config.timeout_seconds, MIN_STARTUP_SECONDS)


class _WatchedRead:
    """The transport's read stream, ending the connection on end of stream or on an item that
    is an exception (the transport could not parse what the server sent)."""

    def __init__(self, inner: ReadStream[SessionMessage | Exception], conn: Connection, eof: str):
        self._inner = inner
        self._conn = conn
        self._eof = eof

    @property
    def last_context(self) -> Any:  # the SDK reads it from context-carrying streams (HTTP)
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        try:
            item = await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._conn.end(self._eof)
            raise
        if isinstance(item, MessageTooLarge):
            self._conn.end(str(item))
        elif isinstance(item, Exception):
            where = "to stdout" if self._conn.config.transport == "stdio" else "in its answer"
            self._conn.end(f"sent something that is not MCP (JSON-RPC) {where}")
        return item

    def __aiter__(self) -> _WatchedRead:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedRead:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class StderrTail:
    """A stdio server's stderr: logged line by line at debug level, the last lines kept."""

    def __init__(self, server: str, redactor: Redactor) -> None:
        self.server = server
        self.redactor = redactor
        read_fd, write_fd = os.pipe()
        self._reader = os.fdopen(read_fd, "rb", buffering=0)
        self.writer: TextIO = os.fdopen(write_fd, "w", encoding="utf-8", errors="replace")
        self.lines: deque[str] = deque(maxlen=STDERR_LINES_KEPT)
        self._partial = b""
        self._eof = asyncio.Event()
        self._transport: asyncio.ReadTransport | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.connect_read_pipe(lambda: _TailProtocol(self), self._reader)

    def feed(self, data: bytes) -> None:
        *complete, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > 8192:  # a line without end: keep its start, not all of it
            complete.append(self._partial)
            self._partial = b""
        for raw in complete:
            line = self.redactor.redact(raw.decode("utf-8", "replace").strip())[:500]
            if line:
                self.lines.append(line)
                log.debug("MCP server %r stderr: %s", self.server, line)

    def finish(self) -> None:
        if self._partial:
            self.feed(b"\n")
        self._eof.set()

    async def last_line(self) -> str | None:
        """The server's last stderr line, once it has exited (waiting a moment for it)."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._eof.wait(), STDERR_SETTLE_SECONDS)
        return self.lines[-1] if self.lines else None

    async def aclose(self) -> None:
        if not self.writer.closed:
            self.writer.close()
        if self._transport is None:
            self._reader.close()
            return
        with suppress(TimeoutError):
            await asyncio.wait_for(self._eof.wait(), STDERR_SETTLE_SECONDS)
        self._transport.close()


class _TailProtocol(asyncio.Protocol):
    def __init__(self, tail: StderrTail) -> None:
        self.tail = tail

    def data_received(self, data: bytes) -> None:
        self.tail.feed(data)

    def eof_received(self) -> bool | None:
        self.tail.finish()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.tail.finish()


def root_cause(exc: BaseException) -> BaseException:
    """The first real failure inside the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        inner = [e for e in exc.exceptions if not isinstance(e, asyncio.CancelledError)]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 1] + "…"


_HIDDEN = False


def hide_from_children() -> None:
    """Linux: make this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) before it starts a
    server, once. A child runs as the same user, and could otherwise read this process's
    ``/proc/<pid>/environ`` (the Slack token and the database URL when they come from the
    environment), follow ``/proc/<pid>/cwd`` to ``.env`` or read its memory; non-dumpable,
    those belong to root. Its other cost: no core dump of this process. Children are not
    affected (``exec`` makes them dumpable again)."""
    global _HIDDEN
    if _HIDDEN or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning(
            "could not hide this process from its MCP servers (prctl: errno %d)", ctypes.get_errno()
        )
    _HIDDEN = True
