"""Approval cards in Slack: the real Bolt app over signed HTTP, a real notes MCP server (SDK,
stdio), the offline model, the Slack stand-in; both databases."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy import text as sql

from bot import texts as text
from core.conversation import Answered, Decided, TurnRequest
from core.storage.models import ToolApproval, User
from core.storage.sessions import SessionStore
from standins.slack import Call, SlackClient, SlackStandIn
from tests.helpers import read_json_line, start_worker
from tests.mcp_support import READY_SECONDS, calls_counted, notes, notes_config
from tests.slack_harness import RunningBot, running_bot

# Every test starts the notes MCP server as a process (stdio): outside the developer's quick
# subset, like every test that starts real processes (README, *The tests*).
pytestmark = pytest.mark.slow

ADD = 'mcp__notes__add_note {"title": "plan", "text": "ship <on> friday"}'


def mcp(tmp_path: Path) -> dict[str, Any]:
    return {"mcp_config": notes_config(tmp_path)}


async def connected(*bots: RunningBot) -> None:
    """The notes server answers in every bot (it starts in the background)."""
    for running in bots:
        tools = running.bot.runtime.tools
        assert tools is not None
        async with asyncio.timeout(READY_SECONDS):
            await tools.wait_for("notes", "connected")


def cards(slack: SlackStandIn) -> list[Call]:
    return [
        c
        for c in slack.named("chat.postMessage")
        if any(
            e.get("action_id") == text.APPROVE
            for b in c.args.get("blocks") or []
            if b.get("type") == "actions"
            for e in b.get("elements", [])
        )
    ]


def approval_id(card: Call) -> str:
    (actions,) = [b for b in card.args["blocks"] if b["type"] == "actions"]
    return str(actions["elements"][0]["value"])


async def click(
    client: SlackClient,
    slack: SlackStandIn,
    card: Call,
    *,
    approve: bool = True,
    user: str = "U1",
    value: str | None = None,
    team: str | None = None,
    retry: bool = False,
) -> int:
    payload = {
        "type": "block_actions",
        "team": {"id": team or client.team, "domain": "test"},
        "user": {"id": user, "team_id": team or client.team},
        "channel": {"id": "C1"},
        "container": {"type": "message", "channel_id": "C1", "message_ts": card.result["ts"]},
        "message": {"ts": card.result["ts"], "thread_ts": card.args["thread_ts"]},
        "trigger_id": "trig",
        "token": "legacy",
        "response_url": slack.response_url,
        "actions": [
            {
                "type": "button",
                "action_id": text.APPROVE if approve else text.DENY,
                "value": approval_id(card) if value is None else value,
                "block_id": "b",
            }
        ],
    }
    del retry  # a retry is the same payload sent again
    return await client.interaction(payload)


def card_updates(slack: SlackStandIn, card: Call) -> list[str]:
    return [c.text for c in slack.named("chat.update") if c.args.get("ts") == card.result["ts"]]


async def test_slack_approval__card_then_approve_runs_the_call_and_the_answer_continues(
    database_url: str, slack: SlackStandIn, store: SessionStore, tmp_path: Path
) -> None:
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        root = await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        assert card.args["thread_ts"] == root
        assert "mcp__notes__add_note" in card.args["text"]
        shown = json.dumps(card.args["blocks"])
        assert "&lt;on&gt;" in shown  # the arguments are escaped
        assert "Show all" not in shown  # nothing folded: the card shows the whole call
        assert notes(tmp_path) == {}
        assert await click(client, slack, card) == 200
        await slack.wait_for(
            lambda: notes(tmp_path) and any("the call ran" in t for t in card_updates(slack, card))
        )
        await slack.wait_for(lambda: "answered" in slack.shown(root))
    assert notes(tmp_path) == {"plan": "ship <on> friday"}


async def test_slack_approval__deny_runs_nothing_and_the_card_says_who(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        root = await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        assert await click(client, slack, card, approve=False) == 200
        await slack.wait_for(lambda: any("Denied by <@U1>" in t for t in card_updates(slack, card)))
        await slack.wait_for(lambda: "declined" in slack.shown(root))
    assert notes(tmp_path) == {}


async def test_slack_approval__others_and_bad_ids_are_refused_and_nothing_changes(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        await connected(bot)
        await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        assert await click(client, slack, card, user="U2") == 200
        assert await click(client, slack, card, value="0" * 32) == 200
        assert await click(client, slack, card, value="not-an-id") == 200
        await slack.wait_for(lambda: len(slack.responses) == 3)
        said = [r["text"] for r in slack.responses]
        assert said[0] == text.approval_refused("not_allowed")
        assert said[1] == said[2] == text.approval_refused("unknown")
        assert all(r.get("response_type") == "ephemeral" for r in slack.responses)
        # Still waiting: the owner can decide it.
        assert await click(client, slack, card) == 200
        await slack.wait_for(lambda: notes(tmp_path))


async def test_slack_approval__two_replicas_clicks_at_once_and_a_retry_run_the_tool_once(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    before = calls_counted("notes", "add_note", "ok")
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as one,
        running_bot(database_url, slack, **mcp(tmp_path)) as two,
        SlackClient(one.url, response_url=slack.response_url) as a,
        SlackClient(two.url, response_url=slack.response_url) as b,
    ):
        await connected(one, two)
        root = await a.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        statuses = await asyncio.gather(
            click(a, slack, card), click(b, slack, card), click(a, slack, card, retry=True)
        )
        assert statuses == [200, 200, 200]
        await slack.wait_for(lambda: "answered" in slack.shown(root))
        await slack.wait_for(lambda: len(slack.responses) == 2)  # the two that lost
    assert calls_counted("notes", "add_note", "ok") - before == 1
    assert all("already decided" in r["text"] for r in slack.responses)


async def test_slack_approval__a_new_message_supersedes_the_card(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        running_bot(database_url, slack, session_poll_seconds=0.1, **mcp(tmp_path)) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        await connected(bot)
        root = await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        await client.message("never mind", thread_ts=root, mention=True)
        await slack.wait_for(lambda: any("Superseded" in t for t in card_updates(slack, card)))
        assert await click(client, slack, card) == 200
        await slack.wait_for(lambda: slack.responses)
        assert slack.responses[0]["text"] == text.approval_refused("superseded")
    assert notes(tmp_path) == {}


async def test_slack_approval__a_malformed_action_payload_is_a_400(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        bad = {
            "type": "block_actions",
            "team": {"id": client.team},
            "user": {"id": ["U1"]},
            "actions": [{"type": "button", "action_id": text.APPROVE, "value": 7}],
        }
        assert await client.interaction(bad) == 400
    assert json.loads(json.dumps(notes(tmp_path))) == {}


@pytest.mark.slow  # a real process
async def test_slack_approval__a_terminal_decision_whose_process_died_continues_in_the_thread(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """The terminal approves what Slack posted and its process dies (SIGKILL) before carrying
    it out: once the staleness window has passed, the replica records the decision as a click
    would, the call runs once, the answer continues in the thread and the card says who."""
    quick = {
        "turn_lock_staleness_seconds": 2,
        "turn_heartbeat_seconds": 0.5,
        "session_poll_seconds": 0.2,
    }
    async with (
        running_bot(database_url, slack, **mcp(tmp_path), **quick) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        before = calls_counted("notes", "add_note", "ok")
        root = await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        child = start_worker("decide", database_url, approval_id(card), "cli:tester", "decided")
        try:
            assert await asyncio.to_thread(read_json_line, child) == {"decided": "Decided"}
        finally:
            child.kill()
            await asyncio.to_thread(child.communicate)
        await slack.wait_for(lambda: "answered" in slack.shown(root), within=60)
        await slack.wait_for(
            lambda: any("tester (terminal); the call ran" in t for t in card_updates(slack, card)),
            within=60,
        )
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
    assert calls_counted("notes", "add_note", "ok") == before + 1  # the call ran once


async def test_slack_approval__a_replica_carries_out_a_terminal_sessions_left_behind_decision(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """A session with no Slack thread (started in the terminal) whose decision was recorded
    and never carried out (its process died): a replica carries it out once, directly."""
    quick = {
        "turn_lock_staleness_seconds": 2,
        "turn_heartbeat_seconds": 0.5,
        "session_poll_seconds": 0.2,
    }
    async with running_bot(database_url, slack, **mcp(tmp_path), **quick) as bot:
        await connected(bot)
        terminal = bot.bot.runtime.conversations("cli")
        operator = await terminal.person("cli:tester", admin=True)
        conversation = await terminal.open("tester/1", owner=operator)
        outcome = await conversation.take_turn(TurnRequest(ADD))
        assert isinstance(outcome, Answered)
        assert outcome.result.approval is not None
        desk = terminal.approvals
        assert desk is not None
        before = calls_counted("notes", "add_note", "ok")
        decided = await desk.decide(
            outcome.result.approval.id, operator, approver_id=None, approve=True, by="cli:tester"
        )
        assert isinstance(decided, Decided)  # ... and its process died here

        async def ran() -> bool:
            record = await desk.get(decided.record.id)
            return record is not None and record.state == "ran"

        for _ in range(1200):  # the database, until the replica carried it out (60 s at most)
            if await ran():
                break
            await asyncio.sleep(0.05)
        assert await ran()
        tail = await conversation.store.tail(conversation.id)
        assert tail is not None
        assert tail.role == "assistant"
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
    assert calls_counted("notes", "add_note", "ok") == before + 1


async def test_slack_approval__a_card_whose_place_was_never_stored_still_shows_the_outcome(
    database_url: str, slack: SlackStandIn, store: SessionStore, tmp_path: Path
) -> None:
    """The replica that posted the card died before storing where it is: the click says where
    (its container), so the card is updated all the same."""
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        root = await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        # The replica stores where the card is just after Slack answered its post: forgetting
        # it before that store lands would be undone by it (seen once on PostgreSQL).
        for _ in range(600):
            async with store.db.read() as conn:
                if await conn.scalar(select(ToolApproval.__table__.c.card_ref)) is not None:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the replica never stored where the card is")
        async with store.db.write() as conn:
            forgotten = update(ToolApproval.__table__).values(card_ref=None, card_state=None)
            await conn.execute(forgotten)
        # Someone not allowed to decide clicks first: refused, and nothing is written (no
        # user row for them, no card reference taken from their payload).
        assert await click(client, slack, card, user="U2") == 200
        await slack.wait_for(lambda: slack.responses or slack.ephemerals("U2"))
        async with store.db.read() as conn:
            assert (await conn.scalar(select(ToolApproval.__table__.c.card_ref))) is None
            stranger = User.__table__.c.external_id == "slack:T1:U2"
            assert (await conn.scalar(select(func.count()).where(stranger))) == 0
        assert await click(client, slack, card) == 200
        await slack.wait_for(lambda: any("the call ran" in t for t in card_updates(slack, card)))
        await slack.wait_for(lambda: "answered" in slack.shown(root))
    assert notes(tmp_path) == {"plan": "ship <on> friday"}


LONG = "y" * 4_000
# "text" sorts before "title": the title comes after a value longer than any card.
ADD_LONG = f'mcp__notes__add_note {{"text": "{LONG} END", "title": "plan\u202e"}}'


async def press(client: SlackClient, card: Call, action_id: str, value: str) -> int:
    return await client.interaction(
        {
            "type": "block_actions",
            "team": {"id": client.team, "domain": "test"},
            "user": {"id": "U5", "team_id": client.team},
            "channel": {"id": "C1"},
            "container": {"type": "message", "channel_id": "C1", "message_ts": card.result["ts"]},
            "message": {"ts": card.result["ts"], "thread_ts": card.args["thread_ts"]},
            "trigger_id": "trig",
            "token": "legacy",
            "actions": [{"type": "button", "action_id": action_id, "value": value}],
        }
    )


async def test_slack_approval__show_all_opens_every_argument_of_the_call(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """The card folds a long value, names the argument after it, escapes what would hide, and
    *Show all* opens the whole call (Slack's limits are the stand-in's)."""
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        await client.message(ADD_LONG, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        shown = json.dumps(card.args["blocks"], ensure_ascii=False)
        assert "plan\\\\u202e" in shown  # the title, its override shown escaped
        assert "\u202e" not in shown
        assert "END" not in shown  # folded on the card...
        assert "characters not shown here" in shown
        assert await press(client, card, text.SHOW_CALL, approval_id(card)) == 200
        (modal,) = await slack.wait_for(lambda: slack.views)
        whole = "".join(
            b["text"]["text"].removeprefix("```").removesuffix("```")
            for b in modal["blocks"]
            if b["type"] == "section"
        )
        assert f"{LONG} END" in whole  # ... and whole in the modal
        assert not any(c.result.get("error") for c in slack.calls)  # within Block Kit's limits
    assert notes(tmp_path) == {}


async def test_slack_approval__a_click_that_could_not_be_recorded_asks_to_click_again(
    database_url: str, slack: SlackStandIn, store: SessionStore, tmp_path: Path
) -> None:
    """Slack never sends a click again (not after a 500): a click whose recording fails is
    acknowledged with a line asking to click again, and the second click runs the call once."""
    async with (
        running_bot(
            database_url, slack, database_statement_timeout_seconds=1, **mcp(tmp_path)
        ) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        await connected(bot)
        root = await client.message(ADD, mention=True)
        (card,) = await slack.wait_for(lambda: cards(slack))
        async with store.db.write() as conn:  # the database refuses the click's writes
            if conn.dialect.name == "postgresql":
                await conn.execute(sql("LOCK TABLE deliveries IN ACCESS EXCLUSIVE MODE"))
            else:  # SQLite: another writer holds the database's write lock
                await conn.execute(update(ToolApproval.__table__).values(card_ref=None))
            assert await click(client, slack, card) == 200
        await slack.wait_for(lambda: slack.responses)
        assert slack.responses[0]["text"] == text.approval_not_recorded()
        assert notes(tmp_path) == {}
        assert await click(client, slack, card) == 200
        await slack.wait_for(lambda: "answered" in slack.shown(root))
    assert notes(tmp_path) == {"plan": "ship <on> friday"}
