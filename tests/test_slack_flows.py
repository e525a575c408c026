"""Exactly-once delivery, busy and stale sessions, on both databases."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import select

from bot import texts as text
from bot.post import Post
from core.conversation import worker as delivery
from core.conversation.intake import Incoming
from core.messages import assistant_message, message_text, slack_message_id, user_message
from core.records import ANY_TAIL, Actor, StoredMessage, TurnLease
from core.storage.deliveries import DELIVERIES
from core.storage.sessions import SessionStore
from standins.openai import GatedModel
from standins.slack import BOT_USER, Call, SlackClient, SlackStandIn
from tests.slack_harness import running_bot


def gated(model: GatedModel, **extra: Any) -> dict[str, Any]:
    return {
        "model_provider": "openai",
        "openai_api_key": "sk-test",
        "openai_base_url": model.base_url,
        **extra,
    }


async def transcript(store: SessionStore, thread_ts: str) -> list[StoredMessage]:
    session = await store.find_session("slack", f"T1/C1/{thread_ts}")
    assert session is not None
    return await store.messages(session.id)


def with_blocks(slack: SlackStandIn, user: str = "U1") -> list[Any]:
    return [c for c in slack.ephemerals(user) if c.args.get("blocks")]


def draft_id(call: Any) -> str:
    (actions,) = [b for b in call.args["blocks"] if b["type"] == "actions"]
    return str(actions["elements"][0]["value"])


async def test_retries_and_double_delivery__one_turn_one_reply(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        ts = client.new_ts()
        await asyncio.gather(
            client.message("only once", ts=ts, mention=True, kind="app_mention"),
            client.message("only once", ts=ts, mention=True, kind="message"),
            *(
                client.message("only once", ts=ts, mention=True, kind=kind, retry=n)
                for n in (1, 2, 3)
                for kind in ("app_mention", "message")
            ),
        )
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        later = await client.message("marker", mention=True)
        await slack.wait_for(
            lambda: slack.replies(later) and len(slack.named("chat.stopStream")) == 2
        )
    assert len(slack.replies(ts)) == 1
    assert [m.role for m in await transcript(store, ts)] == ["user", "assistant"]


async def test_retry_storm__across_two_replicas_still_one_turn_each(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack) as one,
        running_bot(database_url, slack) as two,
        SlackClient(one.url) as a,
        SlackClient(two.url) as b,
    ):
        stamps = [a.new_ts() for _ in range(5)]
        await asyncio.gather(
            *(
                c.message(f"storm {i}", ts=ts, mention=True, kind=kind, retry=retry)
                for i, ts in enumerate(stamps)
                for c in (a, b)
                for kind in ("app_mention", "message")
                for retry in (None, 1)
            )
        )
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) >= 5)
    for ts in stamps:
        assert len(slack.replies(ts)) == 1
        assert [m.role for m in await transcript(store, ts)] == ["user", "assistant"]


async def terminal_turn(store: SessionStore, root: str) -> TurnLease:
    """The terminal client starts a turn on the thread's session (its own engine: ``store``)."""
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    tail = await store.tail(session.id)
    assert tail is not None
    return await store.start_turn(
        session.id,
        user_message=user_message("from the terminal"),
        last_message_id=tail.message_id,
    )


async def busy_elsewhere(
    client: SlackClient, slack: SlackStandIn, store: SessionStore
) -> tuple[str, TurnLease]:
    """A session whose turn runs in the terminal, and a Slack message meeting it busy."""
    root = await client.message("first", mention=True)
    await slack.wait_for(lambda: slack.named("chat.stopStream"))
    lease = await terminal_turn(store, root)
    await client.message("second", thread_ts=root)
    await slack.wait_for(lambda: any(text.busy_notice() == c.text for c in slack.ephemerals()))
    return root, lease


async def test_follow_up__in_the_same_thread_waits_and_is_answered_right_after(
    database_url: str, slack: SlackStandIn, model: GatedModel, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        root = await client.message("first", mention=True)
        await asyncio.wait_for(model.arrived.wait(), 20)
        await client.message("second", thread_ts=root)
        await client.message("third", thread_ts=root, user="U2")
        await slack.wait_for(lambda: len(slack.ephemerals()) == 2)
        # Not "being used elsewhere", no buttons: the thread's own turn is running.
        assert [c.text for c in slack.ephemerals()] == [text.follow_up_notice()] * 2
        assert not with_blocks(slack)
        assert not with_blocks(slack, "U2")
        assert [m.role for m in await transcript(store, root)] == ["user"]
        model.gate.set()
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3)
    texts = [message_text(m.message) for m in await transcript(store, root)]
    assert texts == ["first", "answer 1", "second", "answer 2", "third", "answer 3"]
    assert model.max_in_flight == 1


async def test_busy_ask__notice_then_send_offered_when_free(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root, lease = await busy_elsewhere(client, slack, store)
        (notice,) = slack.ephemerals()
        assert notice.args["thread_ts"] == root
        assert "has not been added yet" in notice.text
        assert not with_blocks(slack)
        await store.finish(lease, [assistant_message("terminal answer")])
        offer = (await slack.wait_for(lambda: with_blocks(slack)))[0]
        # The waiting message is not in the transcript until it is sent.
        assert "second" not in [message_text(m.message) for m in await transcript(store, root)]
        assert await client.button(text.SEND_DRAFT, draft_id(offer)) == 200
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    texts = [message_text(m.message) for m in await transcript(store, root)]
    assert texts[2:5] == ["from the terminal", "terminal answer", "second"]
    assert len(texts) == 6
    # The thread was shown what the terminal added before the answer (one refresh).
    (refresh,) = [c for c in slack.named("chat.postMessage") if "continued elsewhere" in c.text]
    assert "terminal answer" in refresh.text


async def test_busy_ask__discard_adds_nothing(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root, lease = await busy_elsewhere(client, slack, store)
        await store.release(lease)
        offer = (await slack.wait_for(lambda: with_blocks(slack)))[0]
        await client.button(text.DISCARD_DRAFT, draft_id(offer))
        await slack.wait_for(
            lambda: any(c.text == text.draft_discarded() for c in slack.ephemerals())
        )
        await client.button(text.SEND_DRAFT, draft_id(offer))
        await slack.wait_for(lambda: any(c.text == text.draft_gone() for c in slack.ephemerals()))
    assert [message_text(m.message) for m in await transcript(store, root)][2:] == [
        "from the terminal"
    ]


async def test_busy_ask__the_click_can_land_on_another_replica(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack) as one,
        running_bot(database_url, slack) as two,
        SlackClient(one.url) as a,
        SlackClient(two.url) as b,
    ):
        root, lease = await busy_elsewhere(a, slack, store)
        await store.release(lease)
        offer = (await slack.wait_for(lambda: with_blocks(slack)))[0]
        await b.button(text.SEND_DRAFT, draft_id(offer))
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    stored = await transcript(store, root)
    assert [message_text(m.message) for m in stored][2:4] == ["from the terminal", "second"]
    assert [m.role for m in stored][4:] == ["assistant"]


async def test_busy_queue__waiting_messages_are_answered_in_order(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack, busy_mode="queue") as bot,
        SlackClient(bot.url) as client,
    ):
        root = await client.message("first", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        lease = await terminal_turn(store, root)
        await client.message("second", thread_ts=root)
        await slack.wait_for(lambda: len(slack.ephemerals()) == 1)
        await client.message("third", thread_ts=root, user="U2")
        await slack.wait_for(lambda: len(slack.ephemerals()) == 2)
        assert all(c.text == text.busy_queued_notice() for c in slack.ephemerals())
        await store.finish(lease, [assistant_message("terminal answer")])
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3)
    texts = [message_text(m.message) for m in await transcript(store, root)]
    assert texts[2:4] == ["from the terminal", "terminal answer"]
    assert [texts[4], texts[6]] == ["second", "third"]
    assert len(texts) == 8
    assert not with_blocks(slack)
    assert not with_blocks(slack, "U2")


async def test_busy__gives_up_after_the_poll_timeout(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack, busy_poll_timeout_seconds=0.2) as bot,
        SlackClient(bot.url) as client,
    ):
        root, lease = await busy_elsewhere(client, slack, store)
        await slack.wait_for(
            lambda: any(c.text == text.busy_timeout("second") for c in slack.ephemerals())
        )
        await store.finish(lease, [assistant_message("terminal answer")])
    assert "second" not in [message_text(m.message) for m in await transcript(store, root)]


async def test_stale__refresh_once_then_send_anyway(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("from slack", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        # The terminal client continues the session meanwhile.
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        tail = await store.tail(session.id)
        assert tail is not None
        lease = await store.start_turn(
            session.id,
            user_message=user_message("from the terminal"),
            last_message_id=tail.message_id,
        )
        await store.finish(lease, [assistant_message("terminal answer")])

        await client.message("slack again", thread_ts=root)
        offer = (await slack.wait_for(lambda: with_blocks(slack)))[0]
        (refresh,) = [c for c in slack.named("chat.postMessage") if c.args.get("thread_ts") == root]
        assert "continued elsewhere" in refresh.text
        assert "from the terminal" in refresh.text
        assert "terminal answer" in refresh.text
        assert len(await store.messages(session.id)) == 4  # not sent
        await client.button(text.SEND_DRAFT, draft_id(offer))
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    texts = [message_text(m.message) for m in await store.messages(session.id)]
    assert texts[:5] == [
        "from slack",
        texts[1],
        "from the terminal",
        "terminal answer",
        "slack again",
    ]
    assert len(texts) == 6


async def test_stale__a_rewind_elsewhere_is_shown_as_such(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("one", mention=True)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 1)
        await client.message("two", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        messages = await store.messages(session.id)
        await store.truncate(session.id, messages[1].message_id, Actor(None, admin=True))
        await client.message("three", thread_ts=root)
        await slack.wait_for(lambda: with_blocks(slack))
    refresh = [c for c in slack.named("chat.postMessage") if "rewound elsewhere" in c.text]
    assert len(refresh) == 1
    assert len(await store.messages(session.id)) == 2


async def test_busy__an_operation_started_outside_the_thread_says_elsewhere_too(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("first", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        # A compaction from the operator's command line holds the lock (it claims as a turn
        # does, with no user message and no stale guard).
        operation = await store.start_turn(session.id, user_message=None, last_message_id=ANY_TAIL)
        await client.message("meanwhile", thread_ts=root)
        await slack.wait_for(lambda: text.busy_notice() in [c.text for c in slack.ephemerals()])
        assert text.follow_up_notice() not in [c.text for c in slack.ephemerals()]
        await store.release(operation)
        offer = (await slack.wait_for(lambda: with_blocks(slack)))[0]
        await client.button(text.SEND_DRAFT, draft_id(offer))
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    assert [message_text(m.message) for m in await transcript(store, root)][2] == "meanwhile"


async def test_offers__are_replaced_once_clicked_so_they_cannot_be_clicked_twice(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        root, lease = await busy_elsewhere(client, slack, store)
        await store.release(lease)
        offer = (await slack.wait_for(lambda: with_blocks(slack)))[0]
        await client.button(text.SEND_DRAFT, draft_id(offer))
        await slack.wait_for(lambda: slack.responses)
        assert slack.responses == [{"replace_original": True, "text": text.draft_sending()}]
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
        await client.button(text.SEND_DRAFT, draft_id(offer))  # an old copy of the offer
        await slack.wait_for(lambda: len(slack.responses) == 2)
    assert slack.responses[1]["text"] == text.draft_gone()
    assert [message_text(m.message) for m in await transcript(store, root)].count("second") == 1


class OfferHeld:
    """Holds the call that posts an offer until the test has clicked it: the quickest a person
    could ever be."""

    def __init__(self, slack: SlackStandIn) -> None:
        self.posting: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.clicked = asyncio.Event()
        slack.intercept = self._intercept

    async def _intercept(self, method: str, args: dict[str, Any]) -> None:
        if method == "chat.postEphemeral" and args.get("blocks") and not self.posting.done():
            self.posting.set_result(args)
            await self.clicked.wait()

    async def click(self, client: SlackClient, slack: SlackStandIn) -> dict[str, Any]:
        """Send, while the offer is still being posted; what its ``response_url`` got."""
        args = await asyncio.wait_for(self.posting, 20)
        try:
            assert await client.button(text.SEND_DRAFT, draft_id(Call("", args, {}))) == 200
            await slack.wait_for(lambda: slack.responses)
        finally:
            self.clicked.set()
        return slack.responses[-1]


async def test_busy_ask__a_click_before_the_offer_is_even_posted_sends(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        root, lease = await busy_elsewhere(client, slack, store)
        held = OfferHeld(slack)
        await store.finish(lease, [assistant_message("terminal answer")])
        answer = await held.click(client, slack)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    assert answer["text"] == text.draft_sending()
    assert "second" in [message_text(m.message) for m in await transcript(store, root)]


async def test_stale__a_click_before_the_offer_is_even_posted_sends(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        root = await client.message("from slack", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        tail = await store.tail(session.id)
        assert tail is not None
        lease = await store.start_turn(
            session.id,
            user_message=user_message("from the terminal"),
            last_message_id=tail.message_id,
        )
        await store.finish(lease, [assistant_message("terminal answer")])
        held = OfferHeld(slack)
        await client.message("slack again", thread_ts=root)
        answer = await held.click(client, slack)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    assert answer["text"] == text.draft_sending()
    assert "slack again" in [message_text(m.message) for m in await store.messages(session.id)]


async def test_busy_ask__an_offer_slack_refused_is_offered_again_and_still_sends(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    fast = {"turn_lock_staleness_seconds": 1, "turn_heartbeat_seconds": 0.2}
    async with (
        running_bot(database_url, slack, **fast) as bot,
        SlackClient(bot.url, response_url=slack.response_url) as client,
    ):
        root, lease = await busy_elsewhere(client, slack, store)
        slack.errors["chat.postEphemeral"] = "channel_not_found"
        await store.finish(lease, [assistant_message("terminal answer")])
        await slack.wait_for(
            lambda: [c for c in slack.named("chat.postEphemeral") if c.args.get("blocks")]
        )
        del slack.errors["chat.postEphemeral"]
        # The record went back to waiting, ours: once its lease lapses it is taken over and
        # offered again; the offer Slack refused never reached anyone.
        offer = (await slack.wait_for(lambda: [c for c in with_blocks(slack) if c.result["ok"]]))[0]
        assert await client.button(text.SEND_DRAFT, draft_id(offer)) == 200
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    assert slack.responses[-1]["text"] == text.draft_sending()
    assert "second" in [message_text(m.message) for m in await transcript(store, root)]


async def delivery_states(store: SessionStore) -> dict[str, str]:
    async with store.db.read() as conn:
        rows = await conn.execute(select(DELIVERIES.c.event_key, DELIVERIES.c.state))
        return {key.rsplit("/", 1)[-1]: state for key, state in rows}


async def stored(store: SessionStore, ts: str) -> tuple[str, dict[str, Any]]:
    """A delivery record's text and context, as the database holds them."""
    async with store.db.read() as conn:
        found = select(DELIVERIES.c.text, DELIVERIES.c.context).where(
            DELIVERIES.c.event_key == f"T1/C1/{ts}"
        )
        row = (await conn.execute(found)).one()
        return row.text, row.context


def posted(ts: str, text: str, user: str = "U1", **extra: Any) -> dict[str, Any]:
    """A message as conversations.replies lists it."""
    return {"ts": ts, "user": user, "text": text, **extra}


async def test_follow_up_arriving_before_its_threads_first_message__is_answered_after_it(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """Slack delivers events concurrently and retries a failed one a minute later, so a
    follow-up can reach the app before the mention that started its thread. It was
    acknowledged: it must be answered, after the mention, with its words read back from Slack
    (the stray record kept none)."""
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root, follow_up = client.new_ts(), client.new_ts()
        slack.threads[root] = [
            posted(root, f"<@{BOT_USER}> first question"),
            posted(follow_up, "and one more thing", thread_ts=root),
        ]
        await client.message("and one more thing", ts=follow_up, thread_ts=root)
        assert await delivery_states(store) == {follow_up: "stray"}
        kept, where = await stored(store, follow_up)
        assert kept == ""  # where and by whom only
        assert (where["ts"], where["thread_ts"], where["user"]) == (follow_up, root, "U1")
        assert "files" not in where
        assert not slack.named("chat.startStream", "chat.postMessage")
        await client.message("first question", ts=root, mention=True, kind="app_mention")
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    found = await transcript(store, root)
    assert [m.role for m in found] == ["user", "assistant"] * 2
    assert [message_text(found[0].message), message_text(found[2].message)] == [
        "first question",
        "and one more thing",
    ]
    assert await delivery_states(store) == {root: "done", follow_up: "done"}
    # One bounded read of the thread: from the stray to the stray, not the whole thread.
    (read,) = slack.named("conversations.replies")
    assert (read.args["oldest"], read.args["latest"]) == (follow_up, follow_up)


async def test_follow_up_deleted_before_its_thread_was_known__is_dropped_not_answered(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root, follow_up = client.new_ts(), client.new_ts()
        slack.threads[root] = [posted(root, f"<@{BOT_USER}> first question")]  # reply deleted
        await client.message("never mind", ts=follow_up, thread_ts=root)
        await client.message("first question", ts=root, mention=True, kind="app_mention")
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        await slack.wait_for(lambda: slack.named("conversations.replies"))
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]
    assert (await delivery_states(store)).get(follow_up) is None


async def test_stray_whose_thread_became_known_as_it_was_written__its_receiver_adopts_it(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """The listener found the thread unknown, then its first message was recorded and carried
    on before the stray was written: the stray's own receiver looks again and hands it to the
    worker, which reads its words from Slack and answers it."""
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("first question", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        follow_up = client.new_ts()
        slack.threads[root] = [
            posted(root, f"<@{BOT_USER}> first question"),
            posted(follow_up, "one more thing", thread_ts=root),
        ]
        post = Post("T1", "C1", root, follow_up, "U1", "channel")
        late = Incoming(
            event_key=post.ref,
            thread_key=post.thread,
            author="U1",
            message_id=slack_message_id("T1", "C1", follow_up),
            text="",
            context=post.context(),
            stray=True,
        )
        await bot.bot.worker.receive(late, bot.bot.app.client)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    found = await transcript(store, root)
    assert [message_text(m.message) for m in found if m.role == "user"] == [
        "first question",
        "one more thing",
    ]


async def test_strays_slack_would_not_show__wait_for_the_threads_next_message(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """Slack refusing the read (after its retries) leaves the strays as they are: the thread's
    next message carried on adopts them, and both are answered."""
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root, follow_up = client.new_ts(), client.new_ts()
        slack.threads[root] = [
            posted(root, f"<@{BOT_USER}> first question"),
            posted(follow_up, "and one more thing", thread_ts=root),
        ]
        slack.errors["conversations.replies"] = "internal_error"
        await client.message("and one more thing", ts=follow_up, thread_ts=root)
        await client.message("first question", ts=root, mention=True, kind="app_mention")
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        assert (await delivery_states(store))[follow_up] == "stray"
        del slack.errors["conversations.replies"]
        await client.message("and another", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3)
    said = [message_text(m.message) for m in await transcript(store, root) if m.role == "user"]
    assert sorted(said) == ["and another", "and one more thing", "first question"]
    assert said[0] == "first question"


async def test_chatter_before_the_agent_is_called_into_a_thread__is_context_not_answered(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("a thread without the agent")
        chatter = client.new_ts()
        slack.threads[root] = [
            posted(root, "a thread without the agent"),
            posted(chatter, "people talking", user="U2", thread_ts=root),
        ]
        await client.message("people talking", ts=chatter, thread_ts=root, user="U2")
        assert await stored(store, chatter) == (
            "",
            {
                "team": "T1",
                "channel": "C1",
                "thread_ts": root,
                "ts": chatter,
                "user": "U2",
                "surface": "channel",
            },
        )  # the chatter's words are not kept: Slack has them
        call = await client.message("now you", thread_ts=root, mention=True, kind="app_mention")
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        later = await client.message("and a follow-up", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    found = await transcript(store, root)
    assert [message_text(m.message) for m in found if m.role == "user"] == [
        "now you",
        "and a follow-up",
    ]
    # The agent still read what was said before it was called in, from Slack.
    assert "<@U2>: people talking" in found[0].message["metadata"]["context"]
    states = await delivery_states(store)
    assert states == {chatter: "stray", call: "done", later: "done"}


async def test_turns_at_work__waiting_on_the_model_frees_a_place_and_every_turn_finishes(
    database_url: str, slack: SlackStandIn, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two places for turns doing their own work (before and after the model call): six turns
    # must still all reach their model at once, as a turn waiting on it holds no place, and
    # all six must finish, as each takes a place again to store its answer and gives it back.
    monkeypatch.setattr(delivery, "TURNS_AT_WORK", 2)
    async with (
        GatedModel() as model,
        running_bot(database_url, slack, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        roots = [await client.message(f"question {i}", mention=True) for i in range(6)]
        for _ in range(400):
            if model.in_flight == 6:
                break
            await asyncio.sleep(0.05)
        assert model.in_flight == 6
        model.release()
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 6)
    for root in roots:
        assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]


async def test_turns_at_work__waiting_out_slacks_retry_after_frees_a_place(
    database_url: str, slack: SlackStandIn, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two places; two turns whose status call Slack rate-limits for a minute. While they wait
    # it out, a third turn (of another thread: any workspace's) starts and finishes: a wait
    # on Slack is not a turn's own work. Before, the two held both places for the minute.
    monkeypatch.setattr(delivery, "TURNS_AT_WORK", 2)
    slack.rate_limit_next["agents.sessions.setStatus"] = [60, 60]
    async with (
        GatedModel() as model,
        running_bot(database_url, slack, shutdown_grace_seconds=0, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        limited = [await client.message(f"limited {i}", mention=True) for i in range(2)]
        await slack.wait_for(lambda: not slack.rate_limit_next["agents.sessions.setStatus"])
        third = await client.message("and me", mention=True)
        await slack.wait_for(lambda: model.in_flight == 1)
        model.release()
        await slack.wait_for(lambda: slack.replies(third) and slack.named("chat.stopStream"))
        statuses = [c.args["thread_ts"] for c in slack.named("agents.sessions.setStatus")]
        # One call each: the two limited ones are still waiting it out (in either order).
        assert sorted(statuses) == sorted([*limited, third])
    assert [m.role for m in await transcript(store, third)] == ["user", "assistant"]
