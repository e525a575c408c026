"""Tool calls waiting for a person, decided through the HTTP API: the stream asks, the API
decides and carries the call out, and a Slack card follows a decision made on the web (and the
web one made in Slack). A real notes MCP server (stdio), the offline model, both databases."""

from __future__ import annotations

from pathlib import Path

import pytest

from standins.slack import SlackClient, SlackStandIn
from tests.mcp_support import notes
from tests.slack_harness import running_bot
from tests.test_slack_approvals import (
    ADD,
    ADD_LONG,
    LONG,
    card_updates,
    cards,
    click,
    connected,
    mcp,
)
from tests.ui_stream import parse_ui_stream
from tests.web_harness import api_as

pytestmark = pytest.mark.slow


async def test_a_web_session_asks_in_its_stream_and_the_api_decides(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with running_bot(database_url, slack, **mcp(tmp_path)) as bot:
        await connected(bot)
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {})).body
        path = f"/v1/agent_sessions/{session['id']}"
        asked = await web.post(path + "/chat", {"message": ADD, "lastMessageId": None})
        assert asked.status == 200
        message = parse_ui_stream(asked.raw, ai_major=6)
        (waiting,) = [p for p in message["parts"] if p.get("state") == "approval-requested"]
        pending = (await web.get(path)).body["pendingApproval"]
        assert pending["approvalId"] == waiting["approval"]["id"]
        assert pending["toolCallId"] == waiting["toolCallId"]
        other = await api_as(bot, "slack:T1:U2")
        decision = {"approvalId": pending["approvalId"], "approved": True}
        assert (await other.post(path + "/tool_approvals", decision)).status == 404
        assert notes(tmp_path) == {}

        ran = await web.post(path + "/tool_approvals", decision)
        assert ran.status == 200, ran.body
        parse_ui_stream(ran.raw, ai_major=7)
        assert notes(tmp_path) == {"plan": "ship <on> friday"}
        assert (await web.get(path)).body["pendingApproval"] is None
        again = await web.post(path + "/tool_approvals", decision)
        assert again.status == 409
        assert again.body["code"] == "tool_approval_already_decided"
        assert again.body["decision"] in ("ran", "approved", "running")
        assert again.body["decidedBy"] == "slack:T1:U1"
        unknown = await web.post(path + "/tool_approvals", {"approvalId": "x", "approved": True})
        assert unknown.status == 404


async def test_a_decision_on_the_web_clears_the_slack_card_and_the_reverse(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    async with (
        running_bot(database_url, slack, session_poll_seconds=0.2, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        web = await api_as(bot, "slack:T1:U1")
        # Decided in Slack: the web sees nothing pending, and deciding there is refused.
        root = await client.message(ADD, mention=True)
        (first,) = await slack.wait_for(lambda: cards(slack))
        (session,) = (await web.get("/v1/agent_sessions")).body["data"]
        path = f"/v1/agent_sessions/{session['id']}"
        waiting = session["pendingApproval"]
        assert waiting is not None
        assert await click(client, slack, first) == 200
        await slack.wait_for(lambda: notes(tmp_path))
        await slack.wait_for(lambda: "answered" in slack.shown(root))
        late = await web.post(
            path + "/tool_approvals", {"approvalId": waiting["approvalId"], "approved": False}
        )
        assert late.status == 409
        assert late.body["code"] == "tool_approval_already_decided"
        assert (await web.get(path)).body["pendingApproval"] is None
        # Decided on the web: the card in the thread shows it.
        again = ADD.replace("plan", "later")
        await client.message(again, mention=True, thread_ts=root)
        (_, second) = await slack.wait_for(lambda: cards(slack)[1:] and cards(slack))
        pending = (await web.get(path)).body["pendingApproval"]
        assert pending is not None
        assert pending["approvalId"] != waiting["approvalId"]
        decided = await web.post(
            path + "/tool_approvals",
            {"approvalId": pending["approvalId"], "approved": False, "reason": "not on a friday"},
        )
        assert decided.status == 200, decided.body
        parse_ui_stream(decided.raw)
        # The card says who denied it and the reason they gave on the web.
        await slack.wait_for(
            lambda: any(
                "Denied" in t and "not on a friday" in t for t in card_updates(slack, second)
            )
        )
        assert set(notes(tmp_path)) == {"plan"}


async def test_the_api_shows_every_argument_as_a_person_must_read_it(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """``pendingApproval.shown`` is what the page prints: every character of every argument
    (nothing cut at any length) and a right-to-left override written as its escape, so what a
    person approves on the web reads as the call the digest binds, as on Slack's card."""
    async with running_bot(database_url, slack, **mcp(tmp_path)) as bot:
        await connected(bot)
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {})).body
        path = f"/v1/agent_sessions/{session['id']}"
        asked = await web.post(path + "/chat", {"message": ADD_LONG, "lastMessageId": None})
        assert asked.status == 200
        pending = (await web.get(path)).body["pendingApproval"]
        shown = "\n".join(pending["shown"])
        assert "END" in shown
        assert len(shown) > len(LONG)
        assert "\u202e" not in shown
        assert "\\u202e" in shown
        assert pending["input"]["title"] == "plan\u202e"  # the call itself, exactly


async def test_pending_approval_names_who_asked_not_the_owner(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    """In a shared thread anyone may write: U1 starts it (and owns the session), U2's message
    makes the model ask for a call, and the card the API describes says U2 asked."""
    async with (
        running_bot(database_url, slack, **mcp(tmp_path)) as bot,
        SlackClient(bot.url) as client,
    ):
        await connected(bot)
        root = await client.message("hello", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))  # answered
        await client.message(ADD, mention=True, thread_ts=root, user="U2")
        await slack.wait_for(lambda: cards(slack))
        web = await api_as(bot, "slack:T1:U1")
        (session,) = (await web.get("/v1/agent_sessions")).body["data"]
        assert session["owner"]["person"] == "slack:T1:U1"
        assert session["pendingApproval"]["requestedBy"] == "slack:T1:U2"
        path = f"/v1/agent_sessions/{session['id']}"
        assert (await web.get(path)).body["pendingApproval"]["requestedBy"] == "slack:T1:U2"


async def test_a_decisions_reason_is_kept_shown_and_told_to_the_model_and_bounded(
    database_url: str, slack: SlackStandIn, tmp_path: Path, backend: str
) -> None:
    """``reason`` is kept with the decision: the 409 of a second decision shows it, and the
    declined call's part (what the model reads) says who declined and why. Over 500 characters
    is a 400 naming the field, and the request still waits (nothing decided); so is, on
    PostgreSQL, a reason holding a NUL (``database_value_refused``; SQLite would keep it)."""
    async with running_bot(database_url, slack, **mcp(tmp_path)) as bot:
        await connected(bot)
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {})).body
        path = f"/v1/agent_sessions/{session['id']}"
        asked = await web.post(path + "/chat", {"message": ADD, "lastMessageId": None})
        assert asked.status == 200
        pending = (await web.get(path)).body["pendingApproval"]
        decision = {"approvalId": pending["approvalId"], "approved": False}

        long = await web.post(path + "/tool_approvals", {**decision, "reason": "x" * 501})
        assert long.status == 400, long.body
        assert long.body["code"] == "bad_request"
        assert long.body["message"] == "reason: at most 500 characters"
        assert "\n" not in long.body["message"]
        assert (await web.get(path)).body["pendingApproval"]["approvalId"] == pending["approvalId"]
        if backend == "postgresql":
            before = (await web.get(path + "/messages")).body["data"]
            nul = await web.post(path + "/tool_approvals", {**decision, "reason": "no\u0000pe"})
            assert nul.status == 400, nul.raw[:300]
            assert nul.body["code"] == "database_value_refused"
            waiting = (await web.get(path)).body["pendingApproval"]
            assert waiting["approvalId"] == pending["approvalId"]
            assert (await web.get(path + "/messages")).body["data"] == before

        denied = await web.post(path + "/tool_approvals", {**decision, "reason": " not today "})
        assert denied.status == 200, denied.body
        parse_ui_stream(denied.raw)
        assert notes(tmp_path) == {}
        again = await web.post(path + "/tool_approvals", {**decision, "reason": "changed"})
        assert again.status == 409
        assert again.body["decidedBy"] == "slack:T1:U1"
        assert again.body["reason"] == "not today"
        messages = (await web.get(path + "/messages")).body["data"]
        (part,) = [
            p for m in messages for p in m["parts"] if p.get("toolCallId") == pending["toolCallId"]
        ]
        assert part["state"] == "output-denied"
        assert part["approval"]["reason"] == "slack:T1:U1 declined it: not today"
