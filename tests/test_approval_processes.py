"""Approvals across real processes: two ``serve`` replicas sharing one PostgreSQL database (the
one that posted the card killed before the click), and the terminal client (``slack-agent
chat``) deciding what Slack posted and the reverse. Every process runs its own notes MCP server
(the SDK's, over stdio), all writing one notes file, so what ran is visible from here.

Start-up is waited for generously (importing the product and starting an MCP server take
seconds of CPU on a loaded machine); every wait is for something observable, never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from standins.slack import Call, SlackClient, SlackStandIn
from tests.helpers import STARTING
from tests.mcp_support import notes, notes_config
from tests.slack_harness import ServeProcess
from tests.terminal_harness import ChatProcess
from tests.test_slack_approvals import ADD, card_updates, cards, click
from tests.test_terminal import link

pytestmark = pytest.mark.slow

CONNECTED = 'slack_agent_mcp_server_connected{server="notes"} 1.0'


async def connected(serve: ServeProcess, within: float = STARTING) -> None:
    """Until the serve process's notes server answers (its /metrics says so)."""
    deadline = asyncio.get_running_loop().time() + within
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(serve.url + "/metrics") as response:
                if CONNECTED in await response.text():
                    return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("the notes MCP server did not connect")
            await asyncio.sleep(0.1)  # a poll of /metrics, not a synchronising sleep


def env(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "MCP_CONFIG": notes_config(tmp_path),
        "SESSION_POLL_SECONDS": "0.3",
        **extra,
    }


async def serving(*procs: ServeProcess) -> None:
    await asyncio.gather(*(p.ready(STARTING) for p in procs))
    await asyncio.gather(*(connected(p) for p in procs))


@pytest.mark.parametrize("backend", ["postgresql"])
async def test_approval__a_replica_killed_between_card_and_click_the_other_carries_it_out(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    # A short staleness window: what the killed replica held is taken over within seconds.
    quick = {"TURN_LOCK_STALENESS_SECONDS": "3", "TURN_HEARTBEAT_SECONDS": "0.5"}
    one = ServeProcess(database_url, slack, log=tmp_path / "one.log", **env(tmp_path, **quick))
    two = ServeProcess(database_url, slack, log=tmp_path / "two.log", **env(tmp_path, **quick))
    try:
        await serving(one, two)
        async with SlackClient(one.url) as a:
            root = await a.message(ADD, mention=True)
            (card,) = await slack.wait_for(lambda: cards(slack), within=60)
        one.kill()  # SIGKILL: nothing of it is cleaned up
        await one.wait()
        assert notes(tmp_path) == {}
        async with SlackClient(two.url) as b:
            assert await click(b, slack, card) == 200
            await slack.wait_for(lambda: "answered" in slack.shown(root), within=60)
            await slack.wait_for(
                lambda: any("the call ran" in t for t in card_updates(slack, card)), within=60
            )
            # A late second click (Slack's retry, or someone else) changes nothing.
            assert await click(b, slack, card) == 200
            await slack.wait_for(lambda: slack.responses, within=60)
        assert "already decided" in slack.responses[-1]["text"]
        shown = slack.shown(root)
    finally:
        one.kill()
        output = await two.astop()
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
    assert shown.count("answered") == 1, shown  # one continuation, one call
    assert "Traceback" not in output, output


@pytest.mark.parametrize("backend", ["postgresql"])
async def test_approval__a_replica_killed_before_posting_the_card_the_other_posts_it(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """The request is stored and the replica dies while its card is on the way to Slack: the
    replica that takes the message over finds the answer stored and posts the card."""
    quick = {"TURN_LOCK_STALENESS_SECONDS": "3", "TURN_HEARTBEAT_SECONDS": "0.5"}
    posting = asyncio.Event()
    never = asyncio.Event()

    async def hold_the_card(method: str, args: dict[str, Any]) -> None:
        blocks = args.get("blocks") or []
        if method == "chat.postMessage" and any(b.get("type") == "actions" for b in blocks):
            posting.set()
            await never.wait()  # Slack never answers this replica

    one = ServeProcess(database_url, slack, log=tmp_path / "one.log", **env(tmp_path, **quick))
    two = ServeProcess(database_url, slack, log=tmp_path / "two.log", **env(tmp_path, **quick))
    try:
        await serving(one, two)
        slack.intercept = hold_the_card
        async with SlackClient(one.url) as a:
            root = await a.message(ADD, mention=True)
            await asyncio.wait_for(posting.wait(), 60)
        one.kill()
        await one.wait()
        slack.intercept = None
        (card,) = await slack.wait_for(lambda: cards(slack), within=60)  # the other's
        async with SlackClient(two.url) as b:
            assert await click(b, slack, card) == 200
            await slack.wait_for(lambda: "answered" in slack.shown(root), within=60)
            await slack.wait_for(
                lambda: any("the call ran" in t for t in card_updates(slack, card)), within=60
            )
    finally:
        never.set()
        one.kill()
        output = await two.astop()
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
    assert "Traceback" not in output, output


@dataclass
class _Both:
    """A card in Slack and the same request in a terminal client (``card_in_both``)."""

    client: SlackClient
    card: Call
    chat: ChatProcess
    output: str = ""  # the serve process's output, once it stopped


@contextlib.asynccontextmanager
async def card_in_both(
    database_url: str, slack: SlackStandIn, tmp_path: Path, chats: list[ChatProcess]
) -> AsyncIterator[_Both]:
    """A serve process posts the card of an add_note call in a new thread, and a terminal
    client opened on that thread shows the same request waiting, at its prompt."""
    serve = ServeProcess(database_url, slack, log=tmp_path / "serve.log", **env(tmp_path))
    both: _Both | None = None
    try:
        await serving(serve)
        async with SlackClient(serve.url) as client:
            root = await client.message(ADD, mention=True)
            (card,) = await slack.wait_for(lambda: cards(slack), within=60)
            chat = ChatProcess(database_url, link(root), **env(tmp_path))
            chats.append(chat)
            await chat.expect("wants to use mcp__notes__add_note", within=STARTING)
            await chat.prompt()
            both = _Both(client, card, chat)
            yield both
    finally:
        output = await serve.astop()
        if both is not None:
            both.output = output


async def test_approval__the_terminal_approves_what_slack_posted_and_the_card_follows(
    database_url: str, slack: SlackStandIn, tmp_path: Path, chats: list[ChatProcess]
) -> None:
    async with card_in_both(database_url, slack, tmp_path, chats) as both:
        client, card, chat = both.client, both.card, both.chat
        chat.line("/approve")
        await chat.expect("answered")
        # The card in Slack follows within SESSION_POLL_SECONDS, updated by the serve process.
        await slack.wait_for(
            lambda: any("tester (terminal)" in t for t in card_updates(slack, card)),
            within=60,
        )
        assert await click(client, slack, card) == 200  # too late in Slack: refused
        await slack.wait_for(lambda: slack.responses, within=60)
        assert "already decided" in slack.responses[-1]["text"]
        await chat.prompt()
        chat.line("/approve")
        await chat.expect("Nothing waits for a decision")
        await chat.prompt()
        chat.line("/quit")
        assert await chat.exit_status() == 0
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
    assert "Traceback" not in both.output, both.output


async def test_approval__slack_denies_and_the_terminal_stops_asking(
    database_url: str, slack: SlackStandIn, tmp_path: Path, chats: list[ChatProcess]
) -> None:
    async with card_in_both(database_url, slack, tmp_path, chats) as both:
        client, card, chat = both.client, both.card, both.chat
        assert await click(client, slack, card, approve=False) == 200
        await chat.expect("decided or moved on elsewhere")
        await slack.wait_for(
            lambda: any("did not run" in t for t in card_updates(slack, card)), within=60
        )
        await chat.prompt()
        chat.line("/approve")
        await chat.expect("Nothing waits for a decision")
        await chat.prompt()
        chat.line("/quit")
        assert await chat.exit_status() == 0
    assert notes(tmp_path) == {}
    assert "Traceback" not in both.output, both.output
