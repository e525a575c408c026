"""What the agent is told beside a message, on both databases: files shared in the thread
(copied into the sandbox, gone after a rewind to before them, refused when too big or not
readable), the thread before the agent was mentioned, and what the person is looking at."""

from __future__ import annotations

from typing import Any

from bot import texts as text
from core.messages import message_text
from core.providers.base import UserMessage
from core.providers.uimessages import ui_to_chat
from core.storage.sessions import SessionStore
from core.testing.slack import SlackClient, SlackStandIn
from tests.slack_harness import rewind, running_bot


def shared(
    slack: SlackStandIn, name: str, data: bytes, mimetype: str = "text/plain"
) -> dict[str, Any]:
    slack.files[name] = (data, mimetype)
    return {
        "id": f"F{name}",
        "name": name,
        "mimetype": mimetype,
        "size": len(data),
        "url_private_download": slack.file_url(name),
    }


async def answers(store: SessionStore, root: str) -> list[str]:
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    return [
        message_text(m.message) for m in await store.messages(session.id) if m.role == "assistant"
    ]


async def test_file__copied_into_the_sandbox_then_gone_after_a_rewind_to_before_it(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("hello", mention=True)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 1)
        note = shared(slack, "notes.txt", b"numbers: 4 8 15 16 23 42\n")
        await client.message("$ cat files/notes.txt", thread_ts=root, files=[note])
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
        assert "numbers: 4 8 15 16 23 42" in (await answers(store, root))[1]
        first_reply = slack.named("chat.startStream")[0].result["ts"]
        await rewind(client, slack, message_ts=first_reply, thread_ts=root)
        await slack.wait_for(
            lambda: any("rewound" in c.text for c in slack.named("chat.postMessage"))
        )
        await client.message("$ cat files/notes.txt", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3)
    after = (await answers(store, root))[-1]
    assert "numbers" not in after
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    user = [m for m in await store.messages(session.id) if m.role == "user"][-1]
    assert "files/notes.txt" not in str(user.message.get("metadata"))  # not shared this time


async def test_file__too_big_is_refused_and_the_message_still_answered(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack, max_file_bytes=1000) as bot,
        SlackClient(bot.url) as client,
    ):
        big = shared(slack, "big.bin", b"x" * 5000, "application/octet-stream")
        login = shared(slack, "private.txt", b"secret")
        login["url_private_download"] = slack.file_url("private.txt").replace("/files/", "/files/")
        slack.files["private.txt"] = (b"secret", "text/plain")
        root = await client.message("look at these", mention=True, files=[big])
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
    (refusal,) = [c.text for c in slack.ephemerals()]
    assert refusal == text.file_refused("big.bin", "too_big", 1000)
    assert len(await answers(store, root)) == 1


async def test_file__slacks_sign_in_page_is_never_taken_for_the_file(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # A token without files:read gets Slack's HTML sign-in page (with a 200).
    async with (
        running_bot(database_url, slack, slack_bot_token="xoxb-without-files-read") as bot,
        SlackClient(bot.url) as client,
    ):
        report = shared(slack, "report.csv", b"a,b\n1,2\n", "text/csv")
        root = await client.message("$ cat files/report.csv", mention=True, files=[report])
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
    assert [c.text for c in slack.ephemerals()] == [
        text.file_refused("report.csv", "no_access", 10_000_000)
    ]
    assert "Sign in" not in (await answers(store, root))[0]


async def test_thread_context__earlier_messages_go_with_the_first_turn(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    root = "1700000100.000001"
    slack.threads[root] = [
        {"ts": root, "user": "U2", "text": "the build is red again"},
        {"ts": "1700000100.000002", "user": "U3", "text": "since the deploy at noon"},
        {"ts": "1700000100.000003", "bot_id": "B9", "text": "a bot's notice"},
    ]
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        await client.message(
            "what happened?", mention=True, thread_ts=root, user="U1", ts="1700000100.000009"
        )
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        await client.message("and now?", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    first, _, second, _ = await store.messages(session.id)
    context = first.message["metadata"]["context"]
    assert "<@U2>: the build is red again" in context
    assert "<@U3>: since the deploy at noon" in context
    assert "a bot's notice" not in context
    assert message_text(first.message) == "what happened?"  # the person's own words
    assert "context" not in second.message["metadata"]  # only the first turn needs it
    # The model reads the context just before the message.
    (asked,) = [m for m in ui_to_chat([first.message]) if isinstance(m, UserMessage)]
    assert asked.text.index("build is red") < asked.text.index("what happened?")


async def test_app_context__the_channel_the_person_looks_at_goes_with_their_message(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        event = {
            "type": "app_context_changed",
            "user": "U1",
            "context": {"entities": [{"type": "slack#/types/channel_id", "value": "C0LOOK"}]},
            "event_ts": client.new_ts(),
        }
        assert await client.event(event) == 200
        ts = await client.message("what's going on here?", channel="D1", channel_type="im")
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
    session = await store.find_session("slack", f"T1/D1/{ts}")
    assert session is not None
    (first, _) = await store.messages(session.id)
    assert "<#C0LOOK>" in first.message["metadata"]["context"]
