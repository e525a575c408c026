"""The Slack surface over real HTTP: signatures, bad input, conversations."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest

from core.messages import slack_message_id
from core.storage.engine import create_database
from core.storage.sessions import SessionStore
from standins.slack import BOT_USER, SlackClient, SlackStandIn, signed_headers
from tests.slack_harness import OAUTH, RunningBot, oauth_install, running_bot


@pytest.fixture
async def running(database_url: str, slack: SlackStandIn) -> AsyncIterator[RunningBot]:
    async with running_bot(database_url, slack) as bot:
        yield bot


@pytest.fixture
async def client(running: RunningBot) -> AsyncIterator[SlackClient]:
    async with SlackClient(running.url) as c:
        yield c


def final_text(slack: SlackStandIn, thread_ts: str) -> str:
    """What the thread shows of the app's reply: the streamed text as it ended."""
    shown = ""
    for call in slack.calls:
        if call.method == "chat.startStream" and call.args.get("thread_ts") == thread_ts:
            shown = call.text
        elif call.method in ("chat.appendStream", "chat.stopStream") and shown:
            shown += call.text
    return shown


async def test_events__wrong_signature_is_401(client: SlackClient) -> None:
    body = json.dumps({"type": "event_callback", "team_id": "T1", "event": {}})
    headers = signed_headers(body, secret="not-the-secret")
    status, _ = await client.raw(body, headers)
    assert status == 401


async def test_events__timestamp_outside_five_minutes_is_401(client: SlackClient) -> None:
    body = json.dumps({"type": "event_callback", "team_id": "T1", "event": {}})
    headers = signed_headers(body, timestamp=int(time.time()) - 6 * 60)
    status, _ = await client.raw(body, headers)
    assert status == 401


async def test_events__malformed_and_oversized_bodies_are_4xx_and_serving_goes_on(
    client: SlackClient, slack: SlackStandIn
) -> None:
    broken = "{not json"
    status, _ = await client.raw(broken, signed_headers(broken))
    assert 400 <= status < 500
    form = "payload=%7Bnope"
    status, _ = await client.raw(form, signed_headers(form), "application/x-www-form-urlencoded")
    assert 400 <= status < 500
    huge = json.dumps({"type": "event_callback", "pad": "x" * (2 << 20)})
    status, _ = await client.raw(huge, signed_headers(huge))
    assert status == 413
    ts = await client.message("still there?", mention=True)
    await slack.wait_for(lambda: slack.replies(ts))


async def test_events__url_verification_answers_the_challenge(client: SlackClient) -> None:
    body = json.dumps({"type": "url_verification", "challenge": "abc123", "token": "legacy"})
    status, text = await client.raw(body, signed_headers(body))
    assert status == 200
    assert "abc123" in text


async def test_mention__gets_a_streamed_threaded_reply(
    client: SlackClient, slack: SlackStandIn, database_url: str
) -> None:
    ts = await client.message("hello agent", mention=True, kind="app_mention")
    await slack.wait_for(lambda: slack.named("chat.stopStream"))
    (start,) = slack.replies(ts)
    assert start.method == "chat.startStream"
    assert "hello agent" in final_text(slack, ts)
    assert slack.named("agents.sessions.setStatus")

    db = create_database(database_url)
    try:
        store = SessionStore(db)
        session = await store.find_session("slack", f"T1/C1/{ts}")
        assert session is not None
        assert session.title == "hello agent"
        messages = await store.messages(session.id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[0].message_id == slack_message_id("T1", "C1", ts)
    finally:
        await db.dispose()


async def test_thread__follow_up_without_mention_continues_the_session(
    client: SlackClient, slack: SlackStandIn
) -> None:
    root = await client.message("first", mention=True)
    await slack.wait_for(lambda: slack.named("chat.stopStream"))
    await client.message("second, no mention", thread_ts=root)
    await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    assert len(slack.replies(root)) == 2
    # The answer's text reaches Slack in whichever call the pacer was at: start, append or stop.
    assert "second, no mention" in slack.shown(root)


async def test_channel__messages_without_mention_outside_a_session_are_ignored(
    client: SlackClient, slack: SlackStandIn
) -> None:
    root = await client.message("just chatting")
    await client.message("in a thread nobody asked me into", thread_ts=root)
    marker = await client.message("now me", mention=True)
    await slack.wait_for(lambda: slack.replies(marker))
    assert not slack.replies(root)


async def test_dm__starts_a_session_in_its_own_thread(
    client: SlackClient, slack: SlackStandIn
) -> None:
    ts = await client.message("hi in private", channel="D1", channel_type="im")
    await slack.wait_for(lambda: slack.replies(ts))
    assert slack.replies(ts)[0].args["channel"] == "D1"


async def test_bot_messages_and_edits__start_no_turn(
    client: SlackClient, slack: SlackStandIn
) -> None:
    own = client.new_ts()
    await client.event(
        {
            "type": "message",
            "subtype": "bot_message",
            "bot_id": "BBOT",
            "text": f"<@{BOT_USER}> x",
            "ts": own,
            "channel": "C1",
            "channel_type": "channel",
        }
    )
    edited = client.new_ts()
    await client.event(
        {
            "type": "message",
            "subtype": "message_changed",
            "channel": "C1",
            "ts": edited,
            "message": {"text": f"<@{BOT_USER}> y", "user": "U1", "ts": edited},
        }
    )
    marker = await client.message("marker", mention=True)
    await slack.wait_for(lambda: slack.replies(marker))
    assert not slack.replies(own)
    assert not slack.replies(edited)


async def test_fallback__without_streaming_the_reply_is_posted_and_updated(
    database_url: str,
) -> None:
    async with (
        SlackStandIn(streaming=False) as slack,
        running_bot(database_url, slack) as bot,
        SlackClient(bot.url) as client,
    ):
        ts = await client.message("no streaming here", mention=True)
        await slack.wait_for(lambda: slack.named("chat.postMessage"))
        await slack.wait_for(
            lambda: (
                any("no streaming here" in c.text for c in slack.named("chat.update"))
                or any("no streaming here" in c.text for c in slack.named("chat.postMessage"))
            )
        )
    (post,) = [c for c in slack.named("chat.postMessage") if c.args.get("thread_ts") == ts]
    assert post.args["thread_ts"] == ts


async def test_healthz__answers_200_while_the_database_answers(running: RunningBot) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(running.url + "/healthz") as r:
        assert r.status == 200


# slack_sdk's oauth.v2.access uses aiohttp's BasicAuth, which newer aiohttp deprecates.
@pytest.mark.filterwarnings("ignore:BasicAuth is deprecated:DeprecationWarning")
async def test_oauth__install_then_events_are_authorised_from_the_database(
    database_url: str, slack: SlackStandIn
) -> None:
    async with running_bot(database_url, slack, **OAUTH) as bot:
        await oauth_install(bot.url)
        assert slack.named("oauth.v2.access")
        async with SlackClient(bot.url) as client:
            ts = await client.message("installed and talking", mention=True)
            await slack.wait_for(lambda: slack.replies(ts))
    # Replies were sent with the installed bot token, read from the installation store.
    # (The stand-in records arguments, not headers: that the reply exists is the proof that
    # authorisation found the installation.)
    db = create_database(database_url)
    try:
        store = SessionStore(db)
        assert await store.find_session("slack", f"T1/C1/{ts}") is not None
    finally:
        await db.dispose()


async def test_rate_limited__waits_as_told_and_posts_once(
    client: SlackClient, slack: SlackStandIn
) -> None:
    slack.rate_limit_next["chat.startStream"] = [1]
    ts = await client.message("slow down", mention=True)
    await slack.wait_for(lambda: slack.named("chat.stopStream"))
    attempts = [c for c in slack.replies(ts) if c.method == "chat.startStream"]
    assert [c.result["ok"] for c in attempts] == [False, True]  # one retry, one reply
    assert not [c for c in slack.named("chat.postMessage") if c.args.get("thread_ts") == ts]


async def test_temporary_surfaces__a_dm_session_expires_a_channel_one_does_not(
    database_url: str, slack: SlackStandIn
) -> None:
    async with (
        running_bot(database_url, slack, temporary_session_surfaces="dm") as bot,
        SlackClient(bot.url) as client,
    ):
        dm = await client.message("private and passing", channel="D9", channel_type="im")
        public = await client.message("kept", mention=True)
        await slack.wait_for(lambda: slack.replies(dm) and slack.replies(public))
    db = create_database(database_url)
    try:
        store = SessionStore(db)
        dm_session = await store.find_session("slack", f"T1/D9/{dm}")
        channel_session = await store.find_session("slack", f"T1/C1/{public}")
        assert dm_session is not None
        assert channel_session is not None
        assert dm_session.expires_at is not None
        assert channel_session.expires_at is None
    finally:
        await db.dispose()


async def test_thread__a_follow_up_right_after_the_mention_is_not_dropped(
    database_url: str, slack: SlackStandIn
) -> None:
    async with (
        running_bot(database_url, slack, busy_mode="queue") as bot,
        SlackClient(bot.url) as client,
    ):
        root = await client.message("first", mention=True)
        await client.message("right behind it", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    db = create_database(database_url)
    try:
        store = SessionStore(db)
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        messages = await store.messages(session.id)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[0].message_id == slack_message_id("T1", "C1", root)
    finally:
        await db.dispose()
