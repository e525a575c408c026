"""The stdio transport, with what one message from a server may weigh bounded in bytes.

The MCP SDK's ``stdio_client`` keeps the line it is reading in a growing string (joined again
with each 64 KiB chunk, so a long line costs its length squared) and parses a line of any
length on the event loop: a server that answers with 100 MB (a runaway query, a file read
whole, a prompt-steered flood) stalls every turn and lease loop of the replica long before the
result is cut to ``RESULT_CAP`` characters. This transport spawns the server as the SDK does (its
own process group, the SDK's default environment under the declared one) but reads stdout as
bytes, splits lines as they come, and never holds more than ``MAX_MESSAGE_BYTES`` of one line:

- a response past the bound is answered, in its place, with a JSON-RPC error for its request
  (``too_large``), read from the line's head, and the rest of the line is skipped as it
  arrives, so the call ends as an error naming the limit and the server stays connected;
- anything else past the bound (a line whose head is not a response's) is a ``MessageTooLarge``
  item: the connection ends with that reason and its calls fail with it;
- a line above ``THREAD_PARSE_BYTES`` is parsed in a worker thread, off the turns' loop.

Shutdown follows the SDK: close stdin, wait, then terminate the process group.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, TextIO

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    from anyio.abc import ByteReceiveStream, Process
    from mcp.client._transport import TransportStreams
    from mcp.client.stdio import StdioServerParameters
    from mcp.shared.message import SessionMessage

# The most one message from a server may weigh. A tool's result reaches the model cut to
# 20,000 characters, and binary content only as a label; 4 MiB leaves room for a page of text
# with its structured copy and an image or two, and parses in milliseconds.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Lines longer than this are parsed in a worker thread.
THREAD_PARSE_BYTES = 256 * 1024
# How long a server may take to exit once its stdin is closed, then after SIGTERM.
EXIT_GRACE_SECONDS = 2.0
_EXIT_POLL_SECONDS = 0.01
# The head of a JSON-RPC response as SDK servers write it: ``{"jsonrpc":"2.0","id":7,"result":``.
_RESPONSE_HEAD = re.compile(
    rb'\A\s*\{\s*"jsonrpc"\s*:\s*"2\.0"\s*,\s*"id"\s*:\s*(-?\d{1,18}|"[^"\\]{0,200}")\s*,'
    rb'\s*"(?:result|error)"\s*:'
)
_HEAD_BYTES = 512


def too_large(limit: int) -> str:
    """The error text a call gets for an answer past ``limit`` (``McpServer`` recognises it)."""
    return f"the answer is larger than {limit:,} bytes, the most one MCP message may be"


TOO_LARGE_MARK = "the most one MCP message may be"


class MessageTooLarge(ValueError):
    """A server sent a message past the bound that is not a response we can answer for."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"sent a message larger than {limit:,} bytes")
        self.limit = limit


def _parse(line: bytes) -> SessionMessage | Exception:
    from mcp.shared.message import SessionMessage
    from mcp_types import jsonrpc_message_adapter

    try:
        return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


def _refusal(head: bytes, limit: int) -> SessionMessage | Exception:
    """In place of a message past the bound: an error answering its request, when the head
    says which request it answers; otherwise ``MessageTooLarge``."""
    import json

    from mcp.shared.message import SessionMessage
    from mcp_types import ErrorData, JSONRPCError

    match = _RESPONSE_HEAD.match(head)
    if match is None:
        return MessageTooLarge(limit)
    request_id = json.loads(match.group(1))
    error = ErrorData(code=-32000, message=too_large(limit))
    return SessionMessage(JSONRPCError(jsonrpc="2.0", id=request_id, error=error))


async def read_messages(
    stdout: ByteReceiveStream, limit: int = MAX_MESSAGE_BYTES
) -> AsyncIterator[SessionMessage | Exception]:
    """The messages on ``stdout``, one a line, none holding more than ``limit`` bytes in memory.
    Work per chunk is proportional to the chunk: a long line is never joined again and again."""
    pending = bytearray()
    skipping = False  # inside a line already past the bound: drop until its end
    while True:
        try:
            chunk = await stdout.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            return
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            start = len(chunk) if end < 0 else end + 1
            if skipping:
                skipping = end < 0
                continue
            if len(pending) + len(piece) > limit:
                pending += piece[: max(0, _HEAD_BYTES - len(pending))]
                refusal = _refusal(bytes(pending[:_HEAD_BYTES]), limit)
                pending.clear()
                skipping = end < 0
                yield refusal
                continue
            pending += piece
            if end < 0:
                continue
            line = bytes(pending)
            pending.clear()
            if not line.strip():
                continue
            if len(line) > THREAD_PARSE_BYTES:
                yield await anyio.to_thread.run_sync(_parse, line)
            else:
                yield _parse(line)


@asynccontextmanager
async def bounded_stdio_client(
    params: StdioServerParameters, errlog: TextIO, limit: int = MAX_MESSAGE_BYTES
) -> AsyncIterator[TransportStreams]:
    """``mcp.client.stdio.stdio_client`` with stdout read by ``read_messages`` (POSIX; Windows
    keeps the SDK's transport)."""
    from mcp.client.stdio import get_default_environment, stdio_client

    if sys.platform == "win32":  # pragma: no cover
        async with stdio_client(params, errlog) as streams:
            yield streams
        return
    from mcp.shared.message import SessionMessage

    process = await anyio.open_process(
        [params.command, *params.args],
        env=get_default_environment() | (params.env or {}),
        stderr=errlog,
        cwd=params.cwd,
        start_new_session=True,
    )
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def reader() -> None:
        assert process.stdout is not None
        delivering = True
        async with read_writer:
            async for item in read_messages(process.stdout, limit):
                if not delivering:
                    continue  # the session is gone: drain, so the server can exit
                try:
                    await read_writer.send(item)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    delivering = False

    async def writer() -> None:
        assert process.stdin is not None
        try:
            async with write_reader:
                async for message in write_reader:
                    json = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((json + "\n").encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_writer.aclose()  # the session sees the connection end

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(reader)
        tasks.start_soon(writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                read_stream.close()
                write_stream.close()
                await _stop(process)
            tasks.cancel_scope.cancel()


async def _stop(process: Process) -> None:
    """Close stdin, give the server ``EXIT_GRACE_SECONDS`` to exit, then end its group."""
    from mcp.os.posix.utilities import terminate_posix_process_tree

    if process.stdin is not None:
        with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.aclose()
    if not await _exited(process, EXIT_GRACE_SECONDS):
        await terminate_posix_process_tree(process, EXIT_GRACE_SECONDS)
        await _exited(process, EXIT_GRACE_SECONDS)
    if process.stdout is not None:
        with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdout.aclose()


async def _exited(process: Process, seconds: float) -> bool:
    """Whether the process exited within ``seconds`` (polled: ``wait()`` would also wait for
    the pipes, which a child of the server may hold open)."""
    for _ in range(round(seconds / _EXIT_POLL_SECONDS)):
        if process.returncode is not None:
            return True
        await anyio.sleep(_EXIT_POLL_SECONDS)
    return process.returncode is not None
