"""What the agent is told beside a message, on both databases: files shared in the thread
(copied into the sandbox, gone after a rewind to before them, refused when too big or not
readable), the thread before the agent was mentioned, and what the person is looking at."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from bot import texts as text
from bot.files import slack_hosted
from core.errors import ConfigError
from core.messages import message_text
from core.providers.base import UserMessage
from core.providers.uimessages import ui_to_chat
from core.sandbox.shell import BASHKIT_MAX_FILE_BYTES, Sandbox, SandboxLimits
from core.settings import SANDBOX_MAX_FILE_BYTES, load_settings
from core.storage.sessions import SessionStore
from standins.slack import SlackClient, SlackStandIn
from tests.helpers import shell_output
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


async def printed(store: SessionStore, root: str) -> list[str]:
    """What each answer's commands printed in the sandbox (its tool parts' output): the files'
    contents are read there, not in the answer, which says only how a command ended."""
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    return [
        shell_output(m.message) for m in await store.messages(session.id) if m.role == "assistant"
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
        assert "numbers: 4 8 15 16 23 42" in (await printed(store, root))[1]
        first_reply = slack.named("chat.startStream")[0].result["ts"]
        await rewind(client, slack, message_ts=first_reply, thread_ts=root)
        await slack.wait_for(
            lambda: any("rewound" in c.text for c in slack.named("chat.postMessage"))
        )
        await client.message("$ cat files/notes.txt", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3)
    after = (await printed(store, root))[-1]
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
    assert "Sign in" not in (await printed(store, root))[0]


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


async def test_file__on_a_host_that_is_not_slacks_gets_no_token_and_no_request(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # A payload's file object can name any URL: the bot token goes to Slack's hosts only.
    asked: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        asked.append(dict(request.headers))
        return web.Response(body=b"elsewhere", content_type="text/plain")

    app = web.Application()
    app.router.add_get("/{name}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
            foreign = shared(slack, "leak.txt", b"from slack")
            foreign["url_private_download"] = f"http://127.0.0.1:{port}/leak.txt"
            root = await client.message("$ cat files/leak.txt", mention=True, files=[foreign])
            await slack.wait_for(lambda: slack.named("chat.stopStream"))
    finally:
        await runner.cleanup()
    assert asked == []
    assert [c.text for c in slack.ephemerals()] == [
        text.file_refused("leak.txt", "not_slack", 10_000_000)
    ]
    assert "elsewhere" not in (await printed(store, root))[0]


def test_file__slacks_own_hosts_and_the_configured_api_host_are_trusted() -> None:
    api = "http://127.0.0.1:9000/api/"
    assert slack_hosted("https://files.slack.com/files-pri/T1-F1/a.txt", api)
    assert slack_hosted("https://files.slack-gov.com/files-pri/T1-F1/a.txt", api)
    assert slack_hosted("http://127.0.0.1:9000/files/a.txt", api)
    for url in (
        "http://files.slack.com/files-pri/T1-F1/a.txt",  # not over HTTPS
        "https://files.slack.com.evil.example/a.txt",
        "https://files.slack.com:8443/a.txt",
        "https://evil.example/files.slack.com/a.txt",
        "http://127.0.0.1:9001/files/a.txt",
        "not a url",
        "",
    ):
        assert not slack_hosted(url, api), url


async def test_file__more_than_the_sandbox_holds_is_refused_with_a_note_and_the_rest_kept(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        # A session near its state cap: room for the small file, not for both.
        agent = bot.bot.runtime.agent
        room = Sandbox.new().state_bytes() + 4000
        agent.config = replace(agent.config, sandbox_limits=SandboxLimits(max_state_bytes=room))
        small = shared(slack, "small.txt", b"kept words\n")
        big = shared(slack, "big.bin", b"x" * 8000, "application/octet-stream")
        root = await client.message("$ ls files", mention=True, files=[small, big])
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        await client.message("$ cat files/small.txt", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    first, second = await printed(store, root)
    assert "small.txt" in first
    assert "big.bin" not in first.replace("/home/user/files/big.bin was not copied", "")
    assert "/home/user/files/big.bin was not copied into the sandbox" in slack.shown(root)
    assert "kept words" in second  # the message's snapshot was kept, small file and all


def test_max_file_bytes__bounded_by_what_the_sandbox_holds_in_one_file() -> None:
    assert SANDBOX_MAX_FILE_BYTES == BASHKIT_MAX_FILE_BYTES
    with pytest.raises(ConfigError) as refused:
        load_settings(max_file_bytes=25_000_000)
    assert refused.value.message == (
        "MAX_FILE_BYTES: 25000000 is more than the sandbox holds in one file (10000000); "
        "use at most that"
    )


async def test_thread_context__a_long_thread_gives_its_latest_messages_and_earlier_files(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # 450 replies before the mention (Slack pages them oldest first): the agent gets the ones
    # just before it, and the file shared among them.
    root = "1700000200.000001"
    said = [
        {"ts": f"1700000200.{i + 2:06d}", "user": "U2", "text": f"chatter number {i}"}
        for i in range(450)
    ]
    note = shared(slack, "early.txt", b"shared before the mention\n")
    said[440].update(subtype="file_share", files=[note])
    slack.threads[root] = [{"ts": root, "user": "U2", "text": "the thread starts"}, *said]
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        await client.message(
            "$ cat files/early.txt", mention=True, thread_ts=root, ts="1700000200.999999"
        )
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    first, answer = await store.messages(session.id)
    context = first.message["metadata"]["context"]
    assert "chatter number 449" in context  # what was said just before the mention
    assert "chatter number 400" in context
    assert "chatter number 399" not in context  # the latest 50 only
    assert "the thread starts" not in context
    assert "shared before the mention" in shell_output(answer.message)
    pages = slack.named("conversations.replies")
    assert len(pages) == 3  # 200 at a time
