"""Rewind, fork and compact from Slack, with permissions and workspace isolation."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import event

from bot import texts as text
from core.messages import message_text
from core.storage.sessions import SessionStore
from standins.openai import OpenAIStandIn, text_reply
from standins.slack import SlackClient, SlackStandIn
from tests.slack_harness import RunningBot, rewind, running_bot


@pytest.fixture
async def running(database_url: str, slack: SlackStandIn) -> AsyncIterator[RunningBot]:
    async with running_bot(database_url, slack, admin_user_ids="UADMIN") as bot:
        yield bot


@pytest.fixture
async def client(running: RunningBot) -> AsyncIterator[SlackClient]:
    async with SlackClient(running.url) as c:
        yield c


async def conversation(
    client: SlackClient, slack: SlackStandIn, turns: int = 2
) -> tuple[str, list[str], list[str]]:
    """A session thread with ``turns`` exchanges; returns root ts, user ts's, reply ts's."""
    users: list[str] = []
    root = ""
    for i in range(turns):
        before = len(slack.named("chat.stopStream"))
        ts = await client.message(f"question {i}", mention=i == 0, thread_ts=root or None)
        root = root or ts
        users.append(ts)
        await slack.wait_for(lambda n=before + 1: len(slack.named("chat.stopStream")) == n)
    replies = [str(c.result["ts"]) for c in slack.named("chat.startStream")]
    return root, users, replies


async def texts(store: SessionStore, root: str, team: str = "T1", channel: str = "C1") -> list[str]:
    session = await store.find_session("slack", f"{team}/{channel}/{root}")
    assert session is not None
    return [message_text(m.message) for m in await store.messages(session.id)]


def ephemeral_texts(slack: SlackStandIn, user: str | None = None) -> list[str]:
    return [c.text for c in slack.ephemerals(user)]


async def test_rewind__to_a_reply_keeps_it_and_marks_the_later_replies(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, replies = await conversation(client, slack, turns=3)
    modal = await rewind(client, slack, message_ts=replies[0], thread_ts=root)
    # The confirmation said how many messages would leave, before anything changed.
    assert "4 messages will leave the conversation" in json.dumps(modal)
    await slack.wait_for(
        lambda: len([c for c in slack.named("chat.update") if "rewound" in c.text]) == 2
    )
    marked = [c for c in slack.named("chat.update") if "rewound" in c.text]
    assert {c.args["ts"] for c in marked} == set(replies[1:])
    # Posted at the thread's end, the notice links to the message rewound to.
    link = f"https://test.slack.com/archives/C1/p{replies[0].replace('.', '')}"
    notices = [c.text for c in slack.named("chat.postMessage") if "rewound the" in c.text]
    assert len(notices) == 1, notices
    assert f"<{link}|this message>" in notices[0]
    assert len(await texts(store, root)) == 2


async def test_rewind__to_a_user_message_returns_it_as_a_draft(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, _ = await conversation(client, slack, turns=2)
    modal = await rewind(client, slack, message_ts=users[1], thread_ts=root)
    assert "2 messages will leave" in json.dumps(modal)
    await slack.wait_for(lambda: any("question 1" in t for t in ephemeral_texts(slack, "U1")))
    assert await texts(store, root) == ["question 0", (await texts(store, root))[1]]


async def test_rewind__a_reply_slack_will_not_update_still_returns_the_draft(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, replies = await conversation(client, slack, turns=3)
    # The first withdrawn reply cannot be edited (the connection drops on every retry).
    slack.fail_next["chat.update"] = [0, 0, 0, 0]
    await rewind(client, slack, message_ts=users[1], thread_ts=root)
    await slack.wait_for(lambda: any("question 1" in t for t in ephemeral_texts(slack, "U1")))
    marked = [c for c in slack.named("chat.update") if "rewound" in c.text and c.result["ok"]]
    assert {c.args["ts"] for c in marked} == {replies[2]}  # the next one was still marked
    assert await texts(store, root) == ["question 0", (await texts(store, root))[1]]


async def test_rewind__reads_the_messages_that_leave_once_confirmation_and_all(
    running: RunningBot, client: SlackClient, slack: SlackStandIn
) -> None:
    root, _, replies = await conversation(client, slack, turns=3)
    reads: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        flat = " ".join(statement.split())
        # Unfiltered reads of messages (the confirmation reads only those naming an MCP tool).
        unfiltered = "LIKE" not in flat.upper()
        if "agent_session_messages.message," in flat and flat.startswith("SELECT") and unfiltered:
            reads.append(flat)

    engine = running.bot.runtime.storage.sessions.db.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        modal = await rewind(client, slack, message_ts=replies[0], thread_ts=root)
        await slack.wait_for(
            lambda: len([c for c in slack.named("chat.update") if "rewound" in c.text]) == 2
        )
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert "4 messages will leave the conversation" in json.dumps(modal)
    # The target's row, then what leaves (for the replies to mark), once: never to count it.
    assert len([s for s in reads if "position >" in s]) == 1, reads


async def test_rewind__by_someone_else_is_refused_and_changes_nothing(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, replies = await conversation(client, slack, turns=2)
    await client.shortcut("rewind_session", message_ts=replies[0], thread_ts=root, user="U2")
    await slack.wait_for(lambda: text.forbidden("rewind") in ephemeral_texts(slack, "U2"))
    assert len(await texts(store, root)) == 4


async def test_rewind__an_admin_may_rewind_anyones_session(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, replies = await conversation(client, slack, turns=2)
    await rewind(client, slack, message_ts=replies[0], thread_ts=root, user="UADMIN")
    await slack.wait_for(lambda: [c for c in slack.named("chat.update") if "rewound" in c.text])
    assert len(await texts(store, root)) == 2


async def test_shortcut__on_a_message_of_no_session_gets_a_friendly_ephemeral(
    client: SlackClient, slack: SlackStandIn
) -> None:
    stray = client.new_ts()
    await client.shortcut("rewind_session", message_ts=stray, thread_ts=None)
    await slack.wait_for(lambda: text.no_session() in ephemeral_texts(slack))


async def test_fork__anyone_may_fork_into_a_new_thread_they_own(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, replies = await conversation(client, slack, turns=2)
    await client.shortcut("fork_session", message_ts=replies[0], thread_ts=root, user="U2")
    await slack.wait_for(lambda: any("Forked." in t for t in ephemeral_texts(slack, "U2")))
    head = [c for c in slack.named("chat.postMessage") if "Forked from" in c.text]
    new_root = str(head[0].result["ts"])
    assert "thread_ts" not in head[0].args
    forked = await store.find_session("slack", f"T1/C1/{new_root}")
    assert forked is not None
    owner = await store.get_or_create_user("slack:T1:U2")
    assert forked.user_id == owner
    assert len(await texts(store, new_root)) == 2
    assert len(await texts(store, root)) == 4  # the source is untouched
    # The new thread is a session: a message there continues it without a mention.
    before = len(slack.named("chat.stopStream"))
    await client.message("continue the fork", thread_ts=new_root, user="U2")
    await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == before + 1)
    assert (await texts(store, new_root))[2] == "continue the fork"


async def test_compact__shortcut_posts_the_checkpoint_and_refuses_twice(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, _ = await conversation(client, slack, turns=2)
    await client.shortcut("compact_session", message_ts=users[0], thread_ts=root)
    (shown,) = await slack.wait_for(
        lambda: [c for c in slack.named("chat.postMessage") if "compacted" in c.text]
    )
    # Readable sections, not the XML the model reads.
    assert "*Objectives*" in shown.text
    assert "\n• " in shown.text
    assert "<objectives>" not in shown.text
    assert "<checkpoint>" not in shown.text
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    tail = await store.tail(session.id)
    assert tail is not None
    assert tail.is_compaction_message
    await client.shortcut("compact_session", message_ts=users[0], thread_ts=root)
    await slack.wait_for(lambda: text.already_compact() in ephemeral_texts(slack))


async def test_rewind__to_a_checkpoint_keeps_it_and_returns_no_draft(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, _ = await conversation(client, slack, turns=1)
    await client.shortcut("compact_session", message_ts=users[0], thread_ts=root)
    await slack.wait_for(
        lambda: [c for c in slack.named("chat.postMessage") if "compacted" in c.text]
    )
    (posted,) = [c for c in slack.named("chat.postMessage") if "compacted" in c.text]
    before = len(slack.named("chat.stopStream"))
    await client.message("after the checkpoint", thread_ts=root)
    await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == before + 1)
    modal = await rewind(client, slack, message_ts=str(posted.result["ts"]), thread_ts=root)
    # The checkpoint stays; only the exchange after it leaves, and nothing is a draft.
    assert "2 messages will leave" in json.dumps(modal)
    assert "draft" not in json.dumps(modal)
    await slack.wait_for(
        lambda: any("rewound the conversation" in c.text for c in slack.named("chat.postMessage"))
    )
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    tail = await store.tail(session.id)
    assert tail is not None
    assert tail.is_compaction_message
    assert not any("<checkpoint>" in t for t in ephemeral_texts(slack))


async def test_compact__by_someone_else_is_refused(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, _ = await conversation(client, slack, turns=1)
    await client.shortcut("compact_session", message_ts=users[0], thread_ts=root, user="U2")
    await slack.wait_for(lambda: text.forbidden("compact") in ephemeral_texts(slack, "U2"))
    assert len(await texts(store, root)) == 2
    # The thread never heard of it: the owner check comes before the notice.
    assert not [c for c in slack.named("chat.postMessage") if "started compacting" in c.text]


async def test_slash_compact__someone_elses_session_and_no_session_get_the_same_answer(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, _ = await conversation(client, slack, turns=1)
    theirs = f"https://test.slack.com/archives/C1/p{root.replace('.', '')}"
    nothing = "https://test.slack.com/archives/C1/p1700000999000001"
    assert await client.command("/compact", theirs, user="U2") == 200
    assert await client.command("/compact", nothing, user="U2") == 200
    await slack.wait_for(lambda: len(ephemeral_texts(slack, "U2")) == 2)
    first, second = ephemeral_texts(slack, "U2")
    assert first == second == text.compact_nothing_of_yours()
    assert not [c for c in slack.named("chat.postMessage") if "started compacting" in c.text]
    assert len(await texts(store, root)) == 2


async def test_slash_compact__with_a_thread_link_and_focus(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, _ = await conversation(client, slack, turns=1)
    link = f"https://test.slack.com/archives/C1/p{root.replace('.', '')}"
    assert await client.command("/compact", f"{link} the deployment plan") == 200
    await slack.wait_for(
        lambda: [c for c in slack.named("chat.postMessage") if "compacted" in c.text]
    )
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    tail = await store.tail(session.id)
    assert tail is not None
    assert tail.is_compaction_message


async def test_slash_compact__without_a_link_offers_a_picker(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, _ = await conversation(client, slack, turns=1)
    focus = "the deployment plan, " * 40  # longer than Slack lets a button carry
    await client.command("/compact", focus)
    picker = await slack.wait_for(lambda: [c for c in slack.ephemerals() if c.args.get("blocks")])
    (actions,) = [b for b in picker[0].args["blocks"] if b["type"] == "actions"]
    button = actions["elements"][0]
    assert len(button["value"]) < 255
    assert len(button["action_id"]) < 255
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    async with SlackClient(
        client.url.rsplit("/slack/", 1)[0], response_url=slack.response_url
    ) as c:
        # Another person cannot use someone's picker.
        await c.button(button["action_id"], button["value"], user="U2")
        await c.button(button["action_id"], button["value"])
    done = await slack.wait_for(
        lambda: [c for c in slack.named("chat.postMessage") if "compacted" in c.text]
    )
    started = [c for c in slack.named("chat.postMessage") if "started compacting" in c.text]
    assert len(started) == 1  # U2's click on U1's picker did nothing
    assert started[0].args["thread_ts"] == done[0].args["thread_ts"] == root
    # The picker was replaced (it cannot be clicked twice), and the focus, whole, was used.
    assert slack.responses[-1]["replace_original"] is True
    tail = await store.tail(session.id)
    assert tail is not None
    assert tail.is_compaction_message
    assert tail.message["metadata"]["compaction"]["focus"].strip() == focus.strip()


async def test_foreign_workspace__payloads_change_nothing(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, _, replies = await conversation(client, slack, turns=2)
    calls = len(slack.calls)
    await client.shortcut("rewind_session", message_ts=replies[0], thread_ts=root, team="T2")
    await client.message("hello from elsewhere", mention=True, team="T2")
    await client.message("into your thread", thread_ts=root, team="T2")
    marker = await client.message("marker", mention=True)
    await slack.wait_for(lambda: slack.replies(marker))
    assert len(await texts(store, root)) == 4
    foreign = [c for c in slack.calls[calls:] if c.method != "assistant.threads.setStatus"]
    assert all(c.args.get("thread_ts") in (marker, None) for c in foreign)
    assert not any(c.method == "chat.postEphemeral" for c in foreign)


async def test_fork__at_a_user_message_hands_it_to_the_forker_as_a_draft(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, _ = await conversation(client, slack, turns=2)
    await client.shortcut("fork_session", message_ts=users[1], thread_ts=root, user="U2")
    await slack.wait_for(lambda: any("question 1" in t for t in ephemeral_texts(slack, "U2")))
    head = next(c for c in slack.named("chat.postMessage") if "Forked from" in c.text)
    assert len(await texts(store, str(head.result["ts"]))) == 2  # up to just before it


async def test_compact__an_admin_may_compact_anyones_session(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> None:
    root, users, _ = await conversation(client, slack, turns=1)
    await client.shortcut("compact_session", message_ts=users[0], thread_ts=root, user="UADMIN")
    await slack.wait_for(
        lambda: [c for c in slack.named("chat.postMessage") if "compacted" in c.text]
    )
    assert len(await texts(store, root)) == 3


async def test_compact__a_model_error_takes_the_notice_back_and_tells_the_person(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with OpenAIStandIn() as model:
        model.push(text_reply("the only answer"))  # then every request fails (500)
        openai = {
            "model_provider": "openai",
            "openai_api_key": "sk-test",
            "openai_base_url": model.base_url,
        }
        async with running_bot(database_url, slack, **openai) as bot, SlackClient(bot.url) as c:
            root, users, _ = await conversation(c, slack, turns=1)
            await c.shortcut("compact_session", message_ts=users[0], thread_ts=root)
            await slack.wait_for(
                lambda: any("couldn't compact" in t for t in ephemeral_texts(slack, "U1"))
            )
    (started,) = [c for c in slack.named("chat.postMessage") if "started compacting" in c.text]
    deleted = [c.args.get("ts") for c in slack.named("chat.delete")]
    assert deleted == [started.result["ts"]]
    (told,) = [t for t in ephemeral_texts(slack, "U1") if "couldn't compact" in t]
    assert told.startswith(":warning: I couldn't compact this conversation (model_provider")
    assert len(await texts(store, root)) == 2  # nothing was compacted
