"""Slack's own agent features, on both databases: the agent session's status and title, the stop
button (whichever replica runs the turn), renames, and uninstalling."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from slack_sdk.oauth.installation_store import Installation
from sqlalchemy import func, select

from bot import app as bot_app
from bot import texts as text
from core.messages import message_text, slack_message_id
from core.storage.deliveries import DELIVERIES, Deliveries
from core.storage.feedback import votes
from core.storage.sessions import SessionStore
from standins.openai import GatedModel
from standins.slack import BOT_ID, BOT_USER, SlackClient, SlackStandIn, signed_headers
from tests.slack_harness import OAUTH, oauth_install, running_bot


def gated(model: GatedModel, **extra: Any) -> dict[str, Any]:
    return {
        "model_provider": "openai",
        "openai_api_key": "sk-test",
        "openai_base_url": model.base_url,
        **extra,
    }


async def test_agent_session__processing_while_the_turn_runs_then_active_with_the_stop(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("plan the offsite", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
    (processing,) = slack.named("agents.sessions.setStatus")
    assert processing.args["status"] == "processing"
    assert processing.args["thread_ts"] == root
    assert processing.args["title"] == "plan the offsite"  # the first message, no model call
    (stop,) = slack.named("chat.stopStream")
    assert stop.args["session_status"] == "active"  # one call: the reply's end and the status


async def test_stop_button__on_the_replica_not_running_the_turn_stops_it(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        GatedModel(early="the start of a long answer", command="echo begun > begun.txt") as model,
        running_bot(database_url, slack, **gated(model)) as runs,
        running_bot(database_url, slack) as other,
        SlackClient(runs.url) as to_runs,
        SlackClient(other.url) as to_other,
    ):
        root = await to_runs.message("write me a novel", mention=True)
        await asyncio.wait_for(model.arrived.wait(), 20)
        await slack.wait_for(lambda: slack.named("chat.startStream"))
        slack.stopped_streams |= {str(c.result["ts"]) for c in slack.named("chat.startStream")}
        assert await to_other.stop_button(root) == 200
        await slack.wait_for(lambda: text.stopped() in slack.shown(root))
        assert not model.gate.is_set()  # stopped while the model was still writing
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        assert not await store.is_turn_active(session.id)
        # The next message is answered, with no busy notice.
        await to_other.message("$ cat begun.txt", thread_ts=root)
        await slack.wait_for(lambda: "begun" in slack.shown(root))
    assert not slack.ephemerals()
    messages = await store.messages(session.id)
    assert messages[1].message["metadata"]["interrupted_by"] == "stopped"
    assert "the start of a long answer" in message_text(messages[1].message)


async def test_stop_button__for_a_thread_with_nothing_running_changes_nothing(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("hello", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        before = len(slack.calls)
        assert await client.stop_button(root) == 200
        assert await client.stop_button("1700000000.999999") == 200  # not a session thread
        await client.message("and again", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    assert [m.role for m in await store.messages(session.id)] == ["user", "assistant"] * 2
    assert text.stopped() not in "".join(c.text for c in slack.calls[before:])


async def test_rename_in_slack__becomes_the_sessions_title(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("first words", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        event = {
            "type": "agent_session_title_changed",
            "channel": "C1",
            "thread_ts": root,
            "title": "Offsite planning",
            "previous_title": "first words",
            "team_id": "T1",
            "user": "U1",
            "event_ts": client.new_ts(),
        }
        assert await client.event(event) == 200
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    assert session.title == "Offsite planning"


# slack_sdk's oauth.v2.access uses aiohttp's BasicAuth, which newer aiohttp deprecates.
@pytest.mark.filterwarnings("ignore:BasicAuth is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    "order", [("app_uninstalled", "tokens_revoked"), ("tokens_revoked", "app_uninstalled")]
)
async def test_uninstall__in_either_order_twice_removes_the_install_and_stops_turns(
    database_url: str, slack: SlackStandIn, store: SessionStore, order: tuple[str, str]
) -> None:
    async with (
        GatedModel(early="half") as model,
        running_bot(database_url, slack, **OAUTH, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        await oauth_install(bot.url)
        installs = bot.bot.installs
        assert installs is not None
        assert await installs.installations.async_find_bot(enterprise_id=None, team_id="T1")
        root = await client.message("a long one", mention=True)
        await asyncio.wait_for(model.arrived.wait(), 20)
        events = {
            "app_uninstalled": {"type": "app_uninstalled", "event_ts": client.new_ts()},
            "tokens_revoked": {
                "type": "tokens_revoked",
                "tokens": {"oauth": ["U1"], "bot": ["UBOT"]},
                "event_ts": client.new_ts(),
            },
        }
        for kind in (*order, *order):  # either order, and each of them again
            assert await client.event(events[kind]) == 200
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        for _ in range(200):  # the running turn stops (its replica polls once a second)
            if not await store.is_turn_active(session.id):
                break
            await asyncio.sleep(0.05)
        assert not await store.is_turn_active(session.id)
        assert await installs.installations.async_find_bot(enterprise_id=None, team_id="T1") is None
        assert not model.gate.is_set()
    # Nothing else changed: the conversation is still there, under the sweeper's rules.
    roles = [m.role for m in await store.messages(session.id)]
    assert roles == ["user", "assistant"]


@pytest.mark.filterwarnings("ignore:BasicAuth is deprecated:DeprecationWarning")
async def test_oauth__a_workspaces_token_is_asked_about_once_not_in_every_acknowledgement(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """Bolt's multi-workspace authorisation asks Slack's ``auth.test`` for every request unless
    its answer is kept; each message's acknowledgement then waited on a call to Slack (a 429
    there is a second or more). Kept per token, three messages ask once, and an uninstalled
    workspace is still refused (its install is looked up every time)."""
    async with (
        running_bot(database_url, slack, **OAUTH) as bot,
        SlackClient(bot.url) as client,
    ):
        await oauth_install(bot.url)
        before = len(slack.named("auth.test"))
        roots = [await client.message(f"hello {i}", mention=True) for i in range(3)]
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3)
        assert len(slack.named("auth.test")) - before == 1
        uninstalled = {"type": "app_uninstalled", "event_ts": client.new_ts()}
        assert await client.event(uninstalled) == 200
        # A message is recorded before its acknowledgement: acknowledged and not recorded,
        # it was refused by the authorisation (no install), not kept for later.
        late = await client.message("after the uninstall", mention=True)
        async with store.db.read() as conn:
            recorded = await conn.scalar(
                select(func.count())
                .select_from(DELIVERIES)
                .where(DELIVERIES.c.thread_key.like(f"%{late}"))
            )
        assert recorded == 0
    for root in roots:
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        assert [m.role for m in await store.messages(session.id)] == ["user", "assistant"]


async def feedback_click(
    client: SlackClient, value: str, thread_ts: str, *, user: str = "U1"
) -> int:
    """What Slack sends when a person clicks a feedback button under an answer."""
    return await client.interaction(
        {
            "type": "block_actions",
            "team": {"id": "T1", "domain": "test"},
            "user": {"id": user, "team_id": "T1"},
            "channel": {"id": "C1"},
            "message": {"ts": "1", "thread_ts": thread_ts},
            "container": {"type": "message", "channel_id": "C1"},
            "trigger_id": "trig",
            "actions": [{"type": "feedback_buttons", "action_id": text.FEEDBACK, "value": value}],
        }
    )


async def test_feedback__a_vote_is_stored_against_the_answer_and_acknowledged(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("rate me", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        _, answer = await store.messages(session.id)
        assert await feedback_click(client, f"bad:{answer.message_id}", root) == 200
        await slack.wait_for(lambda: text.vote_noted("bad") in [c.text for c in slack.ephemerals()])
        # Changing one's mind replaces the vote; another person's vote counts apart.
        await feedback_click(client, f"good:{answer.message_id}", root)
        await feedback_click(client, f"good:{answer.message_id}", root, user="U2")
        await slack.wait_for(lambda: len(slack.ephemerals()) == 3)
        # A forged value changes nothing.
        await feedback_click(client, f"great:{answer.message_id}", root)
        await feedback_click(client, "good:00000000-0000-4000-8000-000000000000", root)
        await slack.wait_for(lambda: len(slack.ephemerals()) == 5)
    assert await votes(store.db, session.id) == {answer.message_id: {"good": 2}}


async def test_enterprise_grid__an_org_wide_install_answers_and_its_records_are_taken_over(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # slack_sdk stores an org-wide install with the org's id and no team.
    org_wide = Installation(
        app_id="A1",
        enterprise_id="E1",
        team_id=None,
        is_enterprise_install=True,
        bot_token="xoxb-org",
        bot_id=BOT_ID,
        bot_user_id=BOT_USER,
        user_id="U1",
    )
    fast = {"turn_heartbeat_seconds": 0.2, "turn_lock_staleness_seconds": 1}
    async with (
        running_bot(database_url, slack, **OAUTH, **fast) as bot,
        SlackClient(bot.url) as client,
    ):
        installs = bot.bot.installs
        assert installs is not None
        await installs.installations.async_save(org_wide)
        ts = client.new_ts()
        event = {
            "type": "app_mention",
            "user": "U1",
            "text": f"<@{BOT_USER}> hello from the org",
            "ts": ts,
            "channel": "C1",
            "event_ts": ts,
            "channel_type": "channel",
            "team": "T1",
        }
        body = json.dumps(
            {
                "team_id": "T1",
                "enterprise_id": "E1",
                "is_enterprise_install": True,
                "api_app_id": "A1",
                "type": "event_callback",
                "event_id": "EvORG1",
                "event_time": int(time.time()),
                "authorizations": [
                    {
                        "enterprise_id": "E1",
                        "team_id": None,
                        "user_id": BOT_USER,
                        "is_bot": True,
                        "is_enterprise_install": True,
                    }
                ],
                "event": event,
            }
        )
        status, _ = await client.raw(body, signed_headers(body))
        assert status == 200
        await slack.wait_for(lambda: slack.replies(ts))
        (record,) = [r for r in await records(store) if r.event_key == f"T1/C1/{ts}"]
        assert record.context["enterprise"] == "E1"
        # A record no replica holds (its replica stopped): taken over with the org's token.
        later = client.new_ts()
        left = await bot.bot.deliveries.record(
            event_key=f"T1/C1/{later}",
            thread_key=f"T1/C1/{later}",
            author="U1",
            message_id=slack_message_id("T1", "C1", later),
            text="left behind",
            context={**dict(record.context), "ts": later, "thread_ts": later},
            owned=False,
        )
        assert left is not None
        await slack.wait_for(lambda: slack.replies(later))
    assert [r.state for r in await records(store) if r.event_key == f"T1/C1/{later}"] == ["done"]


async def records(store: SessionStore) -> list[Any]:
    deliveries = Deliveries(store.db, "slack")
    async with store.db.read() as conn:
        keys = list((await conn.execute(select(DELIVERIES.c.id))).scalars())
    found = [await deliveries.get(key) for key in keys]
    return [r for r in found if r is not None]


def test_oauth__the_kept_auth_test_answers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound the oldest answer goes (asked again when next needed); a token asked
    about again keeps its place."""
    monkeypatch.setattr(bot_app, "AUTHORIZED_KEPT", 2)
    kept = bot_app._Kept()
    kept["a"], kept["b"] = 1, 2
    kept["b"] = 3
    assert kept == {"a": 1, "b": 3}
    kept["c"] = 4
    assert kept == {"b": 3, "c": 4}
