"""Approvals across real processes: ``serve`` replicas (killed between card and click), and the
terminal client deciding what Slack posted and the reverse; a real notes MCP server (SDK, stdio)
in each process; both databases."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core.storage.sessions import SessionStore
from tests.fake_slack import FakeSlack, SlackClient
from tests.mcp_support import notes, notes_entry, write_config
from tests.slack_harness import ServeProcess
from tests.terminal_harness import ChatProcess
from tests.test_slack_approvals import ADD, approval_id, card_updates, cards, click
from tests.test_terminal import link

pytestmark = pytest.mark.slow


@pytest.fixture
async def chats() -> AsyncIterator[list[ChatProcess]]:
    started: list[ChatProcess] = []
    yield started
    for chat in started:
        chat.kill()


async def connected(serve: ServeProcess, within: float = 90.0) -> None:
    """The serve process's notes server answers (its /metrics says so)."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.get(serve.url + "/metrics") as response:
                if 'slack_agent_mcp_server_connected{server="notes"} 1.0' in await response.text():
                    return
            await asyncio.sleep(0.1)
    raise AssertionError("the notes MCP server did not connect")


def env(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        # A generous timeout: on a loaded machine the SDK server takes long to start.
        "MCP_CONFIG": write_config(tmp_path, {"notes": notes_entry(tmp_path, timeout=600)}),
        "SESSION_POLL_SECONDS": "0.3",
        **extra,
    }


async def test_approval__a_replica_killed_between_card_and_click_another_carries_it_out(
    database_url: str, slack: FakeSlack, tmp_path: Path
) -> None:
    # A short staleness window: the killed replica's records are taken over within seconds.
    quick = {"TURN_LOCK_STALENESS_SECONDS": "3", "TURN_HEARTBEAT_SECONDS": "0.5"}
    one = ServeProcess(database_url, slack, **env(tmp_path, **quick))
    two = ServeProcess(database_url, slack, **env(tmp_path, **quick))
    try:
        await asyncio.gather(one.ready(90), two.ready(90))
        await asyncio.gather(connected(one), connected(two))
        async with SlackClient(one.url) as a:
            root = await a.message(ADD, mention=True)
            (card,) = await slack.wait_for(lambda: cards(slack), within=60)
        one.kill()
        await one.wait()
        async with SlackClient(two.url, response_url=slack.response_url) as b:
            assert await click(b, slack, card) == 200
            await slack.wait_for(lambda: "answered" in slack.shown(root), within=60)
            await slack.wait_for(
                lambda: any("the call ran" in t for t in card_updates(slack, card)), within=60
            )
            # A late second click (say, Slack's retry) changes nothing.
            assert await click(b, slack, card) == 200
            await slack.wait_for(lambda: slack.responses, within=30)
        assert "already decided" in slack.responses[-1]["text"]
    finally:
        one.kill()
        await two.astop()
    assert notes(tmp_path) == {"plan": "ship <on> friday"}


async def test_approval__the_terminal_approves_what_slack_posted_and_the_card_follows(
    database_url: str,
    slack: FakeSlack,
    store: SessionStore,
    tmp_path: Path,
    chats: list[ChatProcess],
) -> None:
    serve = ServeProcess(database_url, slack, **env(tmp_path))
    try:
        await serve.ready(90)
        await connected(serve)
        async with SlackClient(serve.url) as client:
            root = await client.message(ADD, mention=True)
            (card,) = await slack.wait_for(lambda: cards(slack), within=60)
            chat = ChatProcess(database_url, link(root), **env(tmp_path))
            chats.append(chat)
            await chat.expect("wants to use mcp__notes__add_note")
            await chat.prompt()
            chat.line("/approve")
            await chat.expect("answered")
            # The card in Slack follows within SESSION_POLL_SECONDS, on the serve process.
            await slack.wait_for(
                lambda: any("(terminal)" in t for t in card_updates(slack, card)), within=60
            )
            await chat.prompt()
            chat.line("/approve")
            await chat.expect("Nothing waits for a decision")
            await chat.prompt()
            chat.line("/quit")
            assert await chat.exit_status() == 0
    finally:
        await serve.astop()
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
    assert approval_id(card)


async def test_approval__slack_denies_and_the_terminal_stops_asking(
    database_url: str, slack: FakeSlack, tmp_path: Path, chats: list[ChatProcess]
) -> None:
    serve = ServeProcess(database_url, slack, **env(tmp_path))
    try:
        await serve.ready(90)
        await connected(serve)
        async with SlackClient(serve.url) as client:
            root = await client.message(ADD, mention=True)
            (card,) = await slack.wait_for(lambda: cards(slack), within=60)
            chat = ChatProcess(database_url, link(root), **env(tmp_path))
            chats.append(chat)
            await chat.expect("wants to use mcp__notes__add_note")
            await chat.prompt()
            assert await click(client, slack, card, approve=False) == 200
            await chat.expect("decided or moved on elsewhere")
            await chat.prompt()
            chat.line("/quit")
            assert await chat.exit_status() == 0
    finally:
        await serve.astop()
    assert notes(tmp_path) == {}
