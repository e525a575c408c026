"""Never lose an acknowledged message (durable delivery and durable waiting), with real ``serve``
processes on one database, on SQLite and PostgreSQL: a replica killed after acknowledging more
than it could start, a replica killed while a message waits on a busy session, a clean stop
that hands waiting messages over, two replicas racing for one abandoned record, and a
follow-up whose thread's first message was still being handled by the replica that died."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import insert, select, update

from bot import texts as text
from core.agent.turn import run_turn
from core.messages import assistant_message, message_text, user_message
from core.records import StoredMessage
from core.storage.deliveries import DELIVERIES
from core.storage.dialect import ago, db_now
from core.storage.models import Delivery
from core.storage.sessions import SessionStore
from standins.openai import GatedModel
from standins.slack import BOT_ID, BOT_USER, SlackClient, SlackStandIn
from tests.helpers import read_json_line, shell_output, start_worker, stop_workers
from tests.slack_harness import ServeProcess

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

# A short window so take-overs happen within a test, with room for a loaded machine.
LOCK = {"TURN_LOCK_STALENESS_SECONDS": "2", "TURN_HEARTBEAT_SECONDS": "0.25"}
RACED = 500


def model_env(model: GatedModel, **extra: Any) -> dict[str, Any]:
    return {
        "MODEL_PROVIDER": "openai",
        "OPENAI_API_KEY": "sk-test",
        "OPENAI_BASE_URL": model.base_url,
        **extra,
    }


async def transcript(store: SessionStore, root: str) -> list[StoredMessage]:
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    return await store.messages(session.id)


async def texts(store: SessionStore, root: str) -> list[str]:
    return [message_text(m.message) for m in await transcript(store, root)]


async def records(store: SessionStore) -> list[Any]:
    async with store.db.read() as conn:
        return list(await conn.execute(select(DELIVERIES).order_by(DELIVERIES.c.id)))


class TerminalTurn:
    """The terminal client holding a turn on a thread's session, heartbeating as it does
    (the replicas here consider a lock stale after two seconds), until ``finish``."""

    def __init__(self, store: SessionStore, root: str) -> None:
        self.store, self.root = store, root
        self._held, self._done = asyncio.Event(), asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> TerminalTurn:
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._held.wait(), 30)
        return self

    async def _run(self) -> None:
        session = await self.store.find_session("slack", f"T1/C1/{self.root}")
        assert session is not None
        tail = await self.store.tail(session.id)
        assert tail is not None
        async with run_turn(
            self.store,
            session.id,
            user_message=user_message("from the terminal"),
            last_message_id=tail.message_id,
            heartbeat_seconds=0.25,
        ) as turn:
            self._held.set()
            await self._done.wait()
            await turn.finish([assistant_message("terminal answer")])

    async def finish(self) -> None:
        self._done.set()
        assert self._task is not None
        await self._task


async def test_sigkill_after_acknowledging_a_burst__the_other_replica_answers_each_once(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, MAX_CONCURRENT_TURNS="2", **model_env(model, **LOCK))
        b = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        try:
            await asyncio.gather(a.ready(), b.ready())
            async with SlackClient(a.url) as to_a:
                # Every one of these got its 200: Slack will never send them again.
                roots = [await to_a.message(f"burst {i}", mention=True) for i in range(6)]
            for _ in range(400):  # two turns running (the slots), four only recorded
                if model.count == 2:
                    break
                await asyncio.sleep(0.05)
            assert model.count == 2
            a.kill()
            await a.wait()
            model.gate.set()
            await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 6, within=60)
        finally:
            await asyncio.gather(a.astop(), b.astop())
    for root in roots:
        assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]
        assert len(slack.replies(root)) == 1  # no reply posted twice
    resumed = [c for c in slack.named("chat.startStream") if text.resumed() in c.text]
    assert len(resumed) == 2  # the two that had started say they were picked back up
    assert {r.state for r in await records(store)} == {"done"}


@pytest.mark.parametrize("mode", ["queue", "ask"])
async def test_sigkill_while_a_message_waits_on_a_busy_session__another_replica_carries_on(
    database_url: str, slack: SlackStandIn, store: SessionStore, mode: str
) -> None:
    env = {**LOCK, "BUSY_MODE": mode}
    a = ServeProcess(database_url, slack, **env)
    b = ServeProcess(database_url, slack, **env)
    try:
        await asyncio.gather(a.ready(), b.ready())
        async with SlackClient(a.url) as to_a, SlackClient(b.url) as to_b:
            root = await to_a.message("first", mention=True)
            await slack.wait_for(lambda: slack.named("chat.stopStream"))
            terminal = await TerminalTurn(store, root).start()
            await to_a.message("waiting one", thread_ts=root)
            notice = text.busy_queued_notice() if mode == "queue" else text.busy_notice()
            await slack.wait_for(lambda: notice in [c.text for c in slack.ephemerals()])
            waiting = (await records(store))[-1]
            assert (waiting.state, waiting.owner is not None) == ("waiting", True)
            a.kill()
            await a.wait()
            for _ in range(400):  # replica b takes the record over once its lease lapsed
                now = (await records(store))[-1]
                if now.owner not in (None, waiting.owner):
                    break
                await asyncio.sleep(0.05)
            assert now.owner not in (None, waiting.owner)
            await terminal.finish()
            if mode == "ask":
                offer = await slack.wait_for(
                    lambda: [c for c in slack.ephemerals() if c.args.get("blocks")], within=30
                )
                (actions,) = [x for x in offer[0].args["blocks"] if x["type"] == "actions"]
                await to_b.button(text.SEND_DRAFT, actions["elements"][0]["value"])
            await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2, within=30)
    finally:
        await asyncio.gather(a.astop(), b.astop())
    found = await texts(store, root)
    assert found[2:5] == ["from the terminal", "terminal answer", "waiting one"]
    assert len(found) == 6
    assert (await records(store))[-1].state == "done"


async def test_sigterm__a_turn_within_the_grace_finishes_and_waiting_messages_are_handed_over(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # The sweeper thread is on (the default), and the staleness window is the default minute:
    # a clean stop hands its waiting messages over at once, with no window to wait out.
    env = {"SWEEPER_INTERVAL_SECONDS": "3600", "SHUTDOWN_GRACE_SECONDS": "30"}
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, **model_env(model, **env))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                busy_root = await to_a.message("a thread the terminal will hold", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                model.gate.set()
                await slack.wait_for(lambda: slack.named("chat.stopStream"))
                terminal = await TerminalTurn(store, busy_root).start()
                await to_a.message("waiting one", thread_ts=busy_root)
                await slack.wait_for(lambda: slack.ephemerals())
                model.gate.clear()
                model.arrived.clear()
                root = await to_a.message("finish me", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                a.terminate()
                await asyncio.sleep(0.5)  # the stop is under way; the model answers within it
                model.gate.set()
                assert await a.wait() == 0
        finally:
            output = await a.astop()
        assert await texts(store, root) == ["finish me", "answer 2"], output
        assert "answer 2" in slack.shown(root)
        waiting = (await records(store))[-2]
        assert (waiting.state, waiting.owner) == ("waiting", None)  # released, not abandoned
        b = ServeProcess(database_url, slack, **model_env(model))
        try:
            await b.ready()
            await terminal.finish()
            await slack.wait_for(
                lambda: [c for c in slack.ephemerals() if c.args.get("blocks")], within=30
            )
        finally:
            await b.astop()


async def test_sigterm__a_turn_past_the_grace_is_interrupted_keeping_partial_answer_and_sandbox(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    env = {"SWEEPER_INTERVAL_SECONDS": "3600", "SHUTDOWN_GRACE_SECONDS": "0.5"}
    async with GatedModel(early="partial words", command="echo kept > kept.txt") as model:
        a = ServeProcess(database_url, slack, **model_env(model, **env))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("interrupt me", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                await slack.wait_for(lambda: slack.named("chat.startStream"))
                a.terminate()
                assert await a.wait() == 0
        finally:
            output = await a.astop()
    _, answer = await transcript(store, root)
    assert answer.message["metadata"]["interrupted"] is True, output
    assert answer.message["metadata"]["interrupted_by"] == "shutdown"
    assert "partial words" in message_text(answer.message)
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    assert not await store.is_turn_active(session.id)  # released, not left to go stale
    # The thread was told, and the file the command made is in the session's sandbox.
    assert text.shut_down() in slack.shown(root)
    assert [r.state for r in await records(store)] == ["done"]
    b = ServeProcess(database_url, slack)  # the offline model runs "$ ..." in the sandbox
    try:
        await b.ready()
        async with SlackClient(b.url) as to_b:
            await to_b.message("$ cat kept.txt", thread_ts=root)
            await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2, within=30)
    finally:
        await b.astop()
    # what cat printed in the sandbox (the answer says only how the command ended)
    assert shell_output((await transcript(store, root))[-1].message) == "kept\n"


async def test_take_over__two_replicas_racing_never_take_the_same_record(
    database_url: str, store: SessionStore
) -> None:
    row = {
        "surface": "slack",
        "thread_key": "T1/C1/1",
        "author": "U1",
        "message_id": "00000000-0000-4000-8000-000000000000",
        "text": "abandoned",
        "context": {},
        "state": "received",
        "owner": "a-dead-replica",
    }
    for round_ in range(3):
        async with store.db.write() as conn:
            await conn.execute(
                insert(Delivery.__table__).values(lease_at=ago(120)),
                [{**row, "event_key": f"{round_}/{i}"} for i in range(RACED)],
            )
        workers = [start_worker("take_over", database_url, "60") for _ in range(3)]
        try:
            for worker in workers:
                assert read_json_line(worker) == {"ready": True}
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.write("go\n")
                worker.stdin.flush()
            taken = [read_json_line(worker)["taken"] for worker in workers]
        finally:
            stop_workers(workers, wait=10)
        every = [record_id for ids in taken for record_id in ids]
        # Each taken exactly once, none left. (The three start together and take one record
        # per statement, so their statements interleave: a lost race is a real outcome here.)
        assert len(every) == len(set(every)) == RACED, taken


async def test_follow_up__waits_for_its_threads_first_message_taken_over_from_a_dead_replica(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, MAX_CONCURRENT_TURNS="1", **model_env(model, **LOCK))
        b = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        try:
            await asyncio.gather(a.ready(), b.ready())
            async with SlackClient(a.url) as to_a, SlackClient(b.url) as to_b:
                other = await to_a.message("holds replica a's only slot", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                root = await to_a.message("first", mention=True)  # recorded, not started
                await to_b.message("follow-up", thread_ts=root)  # its session does not exist
                await slack.wait_for(lambda: slack.ephemerals())
                assert await store.find_session("slack", f"T1/C1/{root}") is None
                a.kill()
                await a.wait()
                model.gate.set()
                await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 3, within=60)
                # Streams are stopped for dead turns as well as finished ones: what is asserted
                # below is waited for itself (the follow-up's answer stored), not its proxy.
                for _ in range(600):  # a minute at most
                    if len(await texts(store, root)) >= 4:
                        break
                    await asyncio.sleep(0.1)
        finally:
            await asyncio.gather(a.astop(), b.astop())
    assert [m.role for m in await transcript(store, other)] == ["user", "assistant"]
    found = await texts(store, root)
    assert [found[0], found[2]] == ["first", "follow-up"]
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"] * 2


@pytest.mark.parametrize("between", [0, 30])
async def test_sigkill_before_the_reply_is_recorded__the_stream_slack_started_is_stopped(
    database_url: str, slack: SlackStandIn, store: SessionStore, between: int
) -> None:
    """Slack started the reply's stream, the replica died before it heard the answer (so the
    record names no reply): the replica that takes over finds the stream in the thread and
    stops it, then answers in a reply of its own. With ``between`` messages of a busy thread
    (people's, and the agent's replies to them) between the person's and the stream, more
    than one page of the first messages after the person's would hold: it is still found."""
    slack.hold["chat.startStream"] = asyncio.Event()
    async with GatedModel(early="the dead turn began ") as model:
        a = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        b = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("answer me", mention=True)
            started = await slack.wait_for(lambda: slack.named("chat.startStream"))
            orphan = str(started[0].result["ts"])
            busy = [
                {"ts": f"1750000000.{i:06d}", "user": "U2", "text": f"chatter {i}"}
                if i % 2
                else {"ts": f"1750000000.{i:06d}", "user": BOT_USER, "bot_id": BOT_ID}
                for i in range(between)
            ]
            slack.threads[root] = [
                {"ts": root, "user": "U1", "text": "answer me"},
                *busy,
                {"ts": orphan, "user": BOT_USER, "bot_id": BOT_ID, "text": "the dead turn"},
            ]
            earlier = {m["ts"] for m in busy} | {orphan}
            a.kill()
            await a.wait()
            slack.hold.pop("chat.startStream").set()
            model.gate.set()
            await b.ready()
            await slack.wait_for(
                lambda: [
                    c for c in slack.named("chat.stopStream") if c.args.get("ts") not in earlier
                ],
                within=60,
            )
        finally:
            await asyncio.gather(a.astop(), b.astop())
    # Closed, and says why. A turn of the take-over that was itself retried (a lock window
    # this short meets a loaded machine) may ask to close it again: Slack refuses a stream
    # already stopped, so what people see is the one close.
    closes = [c for c in slack.named("chat.stopStream") if c.args.get("ts") == orphan]
    assert closes
    assert text.cut_short() in str(closes[0].args.get("markdown_text"))
    shown = slack.messages[orphan]
    assert not shown.streaming
    assert shown.text.count(text.cut_short()) == 1
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]
    assert {r.state for r in await records(store)} == {"done"}


async def _reply_started(slack: SlackStandIn) -> str:
    started = await slack.wait_for(lambda: slack.named("chat.startStream"), within=60)
    return str(started[0].result["ts"])


async def _stopped_saying(slack: SlackStandIn, ts: str, words: str) -> None:
    await slack.wait_for(
        lambda: [
            c
            for c in slack.named("chat.stopStream")
            if c.args.get("ts") == ts and words in str(c.args.get("markdown_text"))
        ],
        within=30,
    )


async def _all_done(store: SessionStore) -> set[str]:
    for _ in range(300):
        states = {r.state for r in await records(store)}
        if states == {"done"}:
            break
        await asyncio.sleep(0.1)
    return states


async def test_record_taken_over_while_its_turn_runs__the_turn_stops_before_it_answers(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """Another replica holds the message now (its lease lapsed here unnoticed): this replica's
    turn stops at its next lease renewal, its reply saying it will be picked up, instead of
    going on to answer beside the replica that took the message over."""
    async with GatedModel(early="the first words ") as model:
        a = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("answer me", mention=True)
            reply = await _reply_started(slack)
            async with store.db.write() as conn:
                await conn.execute(
                    update(DELIVERIES)
                    .where(DELIVERIES.c.state == "started")
                    .values(owner="another-replica", lease_at=db_now())
                )
            await _stopped_saying(slack, reply, text.will_retry())
            model.gate.set()  # too late for the stopped turn
            # The stand-in owner never renews its lease: this replica takes the message back
            # and finds it answered by what the stopped turn kept.
            assert await _all_done(store) == {"done"}
        finally:
            await a.astop()
    messages = await transcript(store, root)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].message["metadata"]["interrupted_by"] == "record_lost"
    assert not any("answer 1" in m.text for m in slack.messages.values())


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
async def test_lease_renewal_blocked_while_its_turn_runs__the_turn_stops_within_the_window(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """The message's row locked by another transaction (the renewal waits while the turn's own
    heartbeat, on the session's row, goes through): the turn stops before 0.8 of the window,
    before any other replica could take the message over. PostgreSQL only: SQLite has no row
    locks, and a lock on its whole database stops the heartbeat too."""
    async with GatedModel(early="the first words ") as model:
        a = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                await to_a.message("answer me", mention=True)
            reply = await _reply_started(slack)
            async with store.db.write() as conn:
                await conn.execute(
                    select(DELIVERIES.c.id).where(DELIVERIES.c.state == "started").with_for_update()
                )
                await _stopped_saying(slack, reply, text.will_retry())
            model.gate.set()
            assert await _all_done(store) == {"done"}
        finally:
            await a.astop()
    assert not any("answer 1" in m.text for m in slack.messages.values())


async def test_record_taken_over_while_it_waits__its_old_task_never_answers_it(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """A follow-up waits here on a session the terminal holds; its lease lapses unnoticed and
    another replica holds it now. When the session frees, the task that waited here must not
    answer it (it would answer beside that replica): it reads the record again and leaves it.
    The stand-in owner then stops renewing, this replica takes the message over, and it is
    answered once."""
    async with GatedModel() as model:
        model.gate.set()
        env = model_env(model, BUSY_MODE="queue", BUSY_POLL_SECONDS="0.25", **LOCK)
        a = ServeProcess(database_url, slack, **env)
        renewing = asyncio.Event()

        async def another_replica_renews() -> None:
            while not renewing.is_set():
                async with store.db.write() as conn:
                    await conn.execute(
                        update(DELIVERIES)
                        .where(DELIVERIES.c.owner == "another-replica")
                        .values(lease_at=db_now())
                    )
                await asyncio.sleep(0.2)

        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("first", mention=True)
                assert await _all_done(store) == {"done"}  # answered, and the answer stored
                terminal = await TerminalTurn(store, root).start()
                await to_a.message("follow-up", thread_ts=root)
            for _ in range(300):
                if any(r.state == "waiting" for r in await records(store)):
                    break
                await asyncio.sleep(0.1)
            async with store.db.write() as conn:
                await conn.execute(
                    update(DELIVERIES)
                    .where(DELIVERIES.c.state == "waiting")
                    .values(owner="another-replica", lease_at=db_now())
                )
            renewer = asyncio.create_task(another_replica_renews())
            await asyncio.sleep(2.5)  # past 0.9 of the window since this replica renewed it
            await terminal.finish()
            await asyncio.sleep(1.5)  # the waiting task sees the session free, and leaves it
            renewing.set()
            await renewer
            assert await _all_done(store) == {"done"}
        finally:
            await a.astop()
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"] * 3
    assert slack.shown(root).count("answer 2") == 1, slack.shown(root)


async def test_replica_died_after_showing_the_answer__the_take_over_shows_nothing_more(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    """The answer was stored, shown whole and recorded as shown, and the replica died before it
    finished the message's record (whose reply it never got to record): the replica that takes
    the record over finds the message answered and shown, and posts nothing."""
    async with GatedModel() as model:
        model.gate.set()
        a = ServeProcess(database_url, slack, **model_env(model, **LOCK))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("answer me", mention=True)
            assert await _all_done(store) == {"done"}
            assert slack.shown(root).count("answer 1") == 1
            replies = len(slack.named("chat.startStream", "chat.postMessage"))
            async with store.db.write() as conn:  # as the dead replica left it
                await conn.execute(
                    update(DELIVERIES).values(
                        state="started", owner="a-dead-replica", lease_at=ago(120), reply_ref=None
                    )
                )
            assert await _all_done(store) == {"done"}  # taken over, and finished
        finally:
            await a.astop()
    assert len(slack.named("chat.startStream", "chat.postMessage")) == replies
    assert slack.shown(root).count("answer 1") == 1
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]
