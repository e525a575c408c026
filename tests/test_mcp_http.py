"""MCP tools over Streamable HTTP, against the real notes server in a process of its own (so it
can be killed and started again): headers from ``${VAR}``, calls, timeout, a server that dies,
one that is down at start-up and comes up, and secrets in the URL and headers kept out of logs."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from standins.mcp_notes import NotesHttpServer
from standins.processes import free_port
from tests.mcp_support import notes, running

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

TOKEN = "http-token-5b8e1d0c9a7f"
ENVIRON = {**os.environ, "NOTES_TOKEN": TOKEN}


def notes_http(tmp_path: Path, port: int = 0) -> NotesHttpServer:
    env = {"MCP_NOTES_FAULTS": "1", "MCP_NOTES_TOKEN": TOKEN}
    return NotesHttpServer(port=port, env={**env, "MCP_NOTES_FILE": str(tmp_path / "notes.json")})


def entry(url: str, **extra: object) -> dict[str, object]:
    return {"url": url, "headers": {"Authorization": "Bearer ${NOTES_TOKEN}"}, **extra}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NotesHttpServer]:
    with notes_http(tmp_path) as running_server:
        yield running_server


async def test_http__tools_and_a_call_with_headers_from_the_environment(
    tmp_path: Path, server: NotesHttpServer
) -> None:
    async with running(tmp_path, {"web": entry(server.url)}, environ=ENVIRON) as tools:
        assert tools.status()[0].state == "connected"
        names = [spec.name for spec in tools.specs()]
        assert names == [
            "mcp__web__add_note",
            "mcp__web__fault",
            "mcp__web__list_notes",
            "mcp__web__read_note",
        ]
        arguments = {"title": "deploy", "text": "friday"}
        add = "mcp__web__add_note"
        assert tools.needs_approval(add)
        tool = tools.tool(add)
        assert tool is not None
        saved = await tools.call(add, arguments, approval=tool.digest(arguments))
        assert saved.ok, saved
        assert notes(tmp_path) == {"deploy": "friday"}
        read = await tools.call("mcp__web__read_note", {"title": "deploy"})
        assert (read.kind, read.text) == ("ok", "friday")


async def test_http__wrong_token_is_a_failed_server_not_a_crash(
    tmp_path: Path, server: NotesHttpServer
) -> None:
    environ = {**os.environ, "NOTES_TOKEN": "not-the-token"}
    async with running(tmp_path, {"web": entry(server.url)}, environ=environ) as tools:
        status = tools.status()[0]
        assert status.state == "failed"
        assert status.reason is not None
        assert status.reason.startswith("answered with an error")
        assert tools.specs() == []
        assert (await tools.call("mcp__web__list_notes", {})).kind == "unavailable"


async def test_http__timeout_then_a_new_session(tmp_path: Path, server: NotesHttpServer) -> None:
    async with running(tmp_path, {"web": entry(server.url, timeout=1)}, environ=ENVIRON) as tools:
        hung = await tools.call("mcp__web__fault", {"kind": "hang"})
        assert hung.kind == "timeout"
        assert (
            hung.text == "MCP server 'web' did not answer fault within 1 s; it is being restarted"
        )
        after = await tools.call("mcp__web__list_notes", {})
        assert after.ok, after


async def test_http__server_dies_mid_call_then_comes_back(tmp_path: Path) -> None:
    first = notes_http(tmp_path)
    await asyncio.to_thread(first.start)
    try:
        async with running(tmp_path, {"web": entry(first.url)}, environ=ENVIRON) as tools:
            crashed = await tools.call("mcp__web__fault", {"kind": "crash"})
            assert crashed.kind == "server_failed"
            assert crashed.text.startswith("MCP server 'web' ")
            assert crashed.text.endswith(" during the call; it is being restarted")
            gone = await tools.call("mcp__web__list_notes", {})  # nothing listens any more
            assert gone.kind == "unavailable"
            assert gone.text.startswith("MCP server 'web' is unavailable: cannot be reached")

            again = notes_http(tmp_path, port=first.port)
            await asyncio.to_thread(again.start)
            try:
                async with asyncio.timeout(60):
                    await tools.wait_for("web", "connected")
                assert (await tools.call("mcp__web__list_notes", {})).ok
            finally:
                await asyncio.to_thread(again.stop)
    finally:
        await asyncio.to_thread(first.stop)


async def test_http__down_at_start_up_then_up(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    async with running(tmp_path, {"web": entry(url)}, environ=ENVIRON) as tools:
        status = tools.status()[0]
        assert status.state == "failed"
        assert status.reason is not None
        assert status.reason.startswith("cannot be reached (ConnectError")
        assert tools.specs() == []
        later = notes_http(tmp_path, port=port)
        await asyncio.to_thread(later.start)
        try:
            async with asyncio.timeout(60):
                await tools.wait_for("web", "connected")
            assert len(tools.specs()) == 4
        finally:
            await asyncio.to_thread(later.stop)


async def test_http__secrets_in_url_and_headers_never_logged_or_shown(
    tmp_path: Path, server: NotesHttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # the SDK logs the endpoint URL and each request line
    servers = {"web": entry(f"{server.url}?key=${{NOTES_TOKEN}}")}
    async with running(tmp_path, servers, environ=ENVIRON) as tools:
        assert (await tools.call("mcp__web__list_notes", {})).ok
        crashed = await tools.call("mcp__web__fault", {"kind": "crash"})
        shown = [repr(tools), repr(tools.config), *map(repr, tools.status()), crashed.text]
    assert all(TOKEN not in text for text in shown)
    assert "?key=${NOTES_TOKEN}" in caplog.text  # the URL was logged, by its reference
    assert TOKEN not in caplog.text
