"""The turn protocol on both databases: claim, stale guard, fencing, release."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from core.agent.turn import run_turn
from core.errors import (
    AgentSessionBusy,
    AgentSessionLockLost,
    AgentSessionNotFound,
    AgentSessionStale,
    DatabaseError,
    DuplicateMessage,
)
from core.messages import assistant_message, message_text, user_message
from core.providers.uimessages import step_start_part
from core.records import ANY_TAIL, Actor, ModelChoice
from core.storage import queries as q
from core.storage.engine import Database, create_database
from core.storage.models import AgentSessionMessage
from core.storage.sessions import SessionStore
from tests.helpers import (
    add_exchange,
    age_lock,
    as_an_older_replica,
    new_session,
    rewind_as_an_older_replica,
    statements,
    tail_on_row,
    take_over,
)


async def count_messages(db: Database, session_id: int) -> int:
    async with db.read() as conn:
        table = AgentSessionMessage.__table__
        return int(
            await conn.scalar(
                select(func.count()).select_from(table).where(table.c.session_id == session_id)
            )
            or 0
        )


async def test_start_turn__persists_user_message_and_stamps_model(store: SessionStore) -> None:
    _, session = await new_session(store)
    message = user_message("Build me a report on Q3")
    lease = await store.start_turn(
        session.id,
        user_message=message,
        last_message_id=None,
        model=ModelChoice("openai", "gpt-x", None, "openai"),
    )
    after = await store.get_session(session.id)
    assert after.is_turn_active
    assert (after.model_provider, after.model_name, after.builtin_provider) == (
        "openai",
        "gpt-x",
        "openai",
    )
    assert after.title == "Build me a report on Q3"
    assert lease.tail is not None
    assert lease.tail.message_id == message["id"]
    assert [m.message_id for m in await store.messages(session.id)] == [message["id"]]


async def test_claim__second_claimer_is_busy_and_writes_nothing(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    first = await store.start_turn(
        session.id, user_message=user_message("one"), last_message_id=None
    )
    assert first.tail is not None
    with pytest.raises(AgentSessionBusy) as refused:
        await store.start_turn(
            session.id, user_message=user_message("two"), last_message_id=first.tail.message_id
        )
    assert refused.value.code == "agent_session_busy"
    assert await count_messages(db, session.id) == 1


async def test_claim__unknown_session_is_not_found(store: SessionStore) -> None:
    with pytest.raises(AgentSessionNotFound):
        await store.start_turn(999_999, user_message=user_message("x"), last_message_id=None)


async def test_claim__stale_heartbeat_is_taken_over(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    await replica.start_turn(session.id, user_message=user_message("one"), last_message_id=None)
    await age_lock(db, session.id, 61)
    assert not await store.is_turn_active(session.id)
    tail = await store.tail(session.id)
    assert tail is not None
    lease = await store.start_turn(
        session.id, user_message=user_message("two"), last_message_id=tail.message_id
    )
    assert lease.tail is not None
    assert lease.tail.position == 1


async def test_staleness__is_decided_on_the_database_clock(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    """A heartbeat just inside the window (by the database's clock) still holds the lock."""
    _, session = await new_session(store)
    await replica.start_turn(session.id, user_message=user_message("one"), last_message_id=None)
    await age_lock(db, session.id, 55)
    assert await store.is_turn_active(session.id)
    tail = await store.tail(session.id)
    assert tail is not None
    with pytest.raises(AgentSessionBusy):
        await store.start_turn(
            session.id, user_message=user_message("x"), last_message_id=tail.message_id
        )
    short = SessionStore(db, staleness_seconds=50)
    assert not await short.is_turn_active(session.id)


async def test_stale__wrong_last_message_id_is_refused_and_claims_nothing(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    with pytest.raises(AgentSessionStale) as refused:
        await store.start_turn(
            session.id, user_message=user_message("late"), last_message_id=ids[0]
        )
    assert refused.value.code == "agent_session_stale"
    assert refused.value.actual_last_message_id == ids[1]
    assert not await store.is_turn_active(session.id)
    assert await count_messages(db, session.id) == 2


async def test_stale__null_is_right_only_for_an_empty_session(store: SessionStore) -> None:
    _, session = await new_session(store)
    lease = await store.start_turn(
        session.id, user_message=user_message("first"), last_message_id=None
    )
    await store.finish(lease, [assistant_message("hello")])
    with pytest.raises(AgentSessionStale):
        await store.start_turn(session.id, user_message=user_message("x"), last_message_id=None)


async def test_stale__an_append_racing_the_claim_cannot_slip_through(
    store: SessionStore, db: Database, database_url: str
) -> None:
    """Two clients both believe the tail is X; whichever commits second is refused.

    The winner's user message moves the tail inside its claim transaction, so the loser is
    either busy (lock still held) or stale (lock released, tail moved) but never accepted.
    """
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    other = SessionStore(create_database(database_url))  # a second client, its own engine
    try:
        results = await asyncio.gather(
            store.start_turn(session.id, user_message=user_message("a"), last_message_id=ids[-1]),
            other.start_turn(session.id, user_message=user_message("b"), last_message_id=ids[-1]),
            return_exceptions=True,
        )
    finally:
        await other.db.dispose()
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(r, AgentSessionBusy) for r in results if isinstance(r, BaseException))
    await store.finish(winners[0])
    with pytest.raises(AgentSessionStale):
        await store.start_turn(session.id, user_message=user_message("b"), last_message_id=ids[-1])
    assert await count_messages(db, session.id) == 3


async def test_fencing__taken_over_turn_cannot_heartbeat_append_or_release(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    old = await replica.start_turn(
        session.id, user_message=user_message("one"), last_message_id=None
    )
    assert old.tail is not None
    await age_lock(db, session.id, 120)
    new = await store.start_turn(
        session.id, user_message=user_message("two"), last_message_id=old.tail.message_id
    )
    for attempt in (
        replica.heartbeat(old),
        replica.append(old, [assistant_message("late answer")]),
        replica.finish(old, [assistant_message("late answer")]),
        replica.release(old),
    ):
        with pytest.raises(AgentSessionLockLost) as lost:
            await attempt
        assert lost.value.code == "agent_session_lock_lost"
    assert await store.is_turn_active(session.id)
    assert [m.message["parts"][0]["text"] for m in await store.messages(session.id)] == [
        "one",
        "two",
    ]
    await store.heartbeat(new)
    await store.finish(new, [assistant_message("answer two")])
    assert not await store.is_turn_active(session.id)


async def test_fencing__rewound_stale_turn_cannot_write(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    """A rewind that takes over a stale lock clears its token: the dead turn stays dead."""
    from core.records import Actor

    user_id, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    old = await replica.start_turn(
        session.id, user_message=user_message("two"), last_message_id=ids[-1]
    )
    await age_lock(db, session.id, 120)
    await store.truncate(session.id, ids[1], Actor(user_id))
    with pytest.raises(AgentSessionLockLost):
        await replica.append(old, [assistant_message("zombie")])
    assert [m.message_id for m in await store.messages(session.id)] == ids


async def test_finish__appends_in_order_and_releases(store: SessionStore) -> None:
    _, session = await new_session(store)
    lease = await store.start_turn(session.id, user_message=user_message("q"), last_message_id=None)
    first = await store.append(lease, [assistant_message("thinking")])
    last = await store.finish(lease, [assistant_message("a"), assistant_message("b")])
    assert [first[0].position] + [m.position for m in last] == [1, 2, 3]
    assert not await store.is_turn_active(session.id)


async def test_start_turn__duplicate_message_id_is_refused(store: SessionStore) -> None:
    _, session = await new_session(store)
    message = user_message("once")
    lease = await store.start_turn(session.id, user_message=message, last_message_id=None)
    await store.finish(lease)
    _, other = await new_session(store, key="T1/C1/other")
    with pytest.raises(DuplicateMessage):
        await store.start_turn(other.id, user_message=message, last_message_id=None)
    assert not await store.is_turn_active(other.id)


async def test_import__clears_a_stale_turns_token_so_it_cannot_write_after(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    lease = await store.start_turn(
        session.id, user_message=user_message("then it died"), last_message_id=ids[-1]
    )
    await age_lock(db, session.id, 120)
    assert await replica.import_messages(session.id, [(assistant_message("imported"), False)]) == 1
    with pytest.raises(AgentSessionLockLost):
        await store.finish(lease, [assistant_message("too late")])
    texts = [message_text(m.message) for m in await store.messages(session.id)]
    assert texts[-2:] == ["then it died", "imported"]
    assert not await store.is_turn_active(session.id)


async def test_insert__only_a_stored_message_id_is_reported_as_a_duplicate(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    taken_position = q.message_row(session.id, 0, user_message("same position"))
    with pytest.raises(DatabaseError) as refused:
        async with db.write() as conn:
            await q.insert_messages(conn, [taken_position])
    assert not isinstance(refused.value, DuplicateMessage)
    assert refused.value.code == "database_error"
    (stored,) = [m for m in await store.messages(session.id) if m.message_id == ids[0]]
    same_id = q.message_row(session.id, 5, stored.message)
    with pytest.raises(DuplicateMessage):
        async with db.write() as conn:
            await q.insert_messages(conn, [same_id])


async def test_run_turn__failure_persists_partial_output_as_interrupted(
    store: SessionStore,
) -> None:
    _, session = await new_session(store)

    async def model_fails_mid_answer() -> None:
        async with run_turn(
            store, session.id, user_message=user_message("q"), last_message_id=None
        ) as turn:
            turn.partial = assistant_message("Half an ans")
            raise RuntimeError("model fell over")

    with pytest.raises(RuntimeError, match="model fell over"):
        await model_fails_mid_answer()
    messages = await store.messages(session.id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].message["metadata"] == {"interrupted": True, "interrupted_by": "error"}
    assert messages[1].message["parts"][0]["text"] == "Half an ans"
    assert not await store.is_turn_active(session.id)


async def test_run_turn__failure_before_the_model_said_anything_keeps_no_empty_answer(
    store: SessionStore,
) -> None:
    """Its message is answered again from the transcript: an empty interrupted answer after it
    made the resume take the message as answered, and no reply was ever posted."""
    _, session = await new_session(store)

    async def fails_while_waiting_for_the_model() -> None:
        async with run_turn(
            store, session.id, user_message=user_message("q"), last_message_id=None
        ) as turn:
            turn.partial = {**assistant_message(""), "parts": [step_start_part()]}
            raise RuntimeError("the database went away")

    with pytest.raises(RuntimeError, match="went away"):
        await fails_while_waiting_for_the_model()
    assert [m.role for m in await store.messages(session.id)] == ["user"]
    assert not await store.is_turn_active(session.id)


async def test_run_turn__heartbeat_keeps_the_lock_and_detects_takeover(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    with pytest.raises(AgentSessionLockLost):  # noqa: PT012 (the turn's whole life)
        async with run_turn(
            store,
            session.id,
            user_message=user_message("q"),
            last_message_id=None,
            heartbeat_seconds=0.05,
        ) as turn:
            await age_lock(db, session.id, 59)
            # Wait (bounded) until a heartbeat has refreshed the lock well inside the window.
            short = SessionStore(db, staleness_seconds=30)
            for _ in range(200):
                if await short.is_turn_active(session.id):
                    break
                await asyncio.sleep(0.01)
            assert await short.is_turn_active(session.id)
            # Another replica, after the window. Its own task: once its write commits, the
            # heartbeat may cancel this one before the take-over has returned its lease.
            taking = asyncio.ensure_future(take_over(db, session.id))
            await asyncio.shield(taking)
            # The heartbeat finds the lock taken over and stops the turn's task:
            # this wait is cancelled, and the turn ends with AgentSessionLockLost.
            await asyncio.sleep(30)
    assert turn.lost.is_set()
    assert await store.is_turn_active(session.id)  # the exit did not release the thief's lock
    await replica.release(await taking)


async def test_claim__same_process_claims_queue_and_refuse_without_a_query(
    store: SessionStore, db: Database
) -> None:
    """Claims from one process for one session: one wins, the rest are refused in-process."""
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    results = await asyncio.gather(
        *(
            store.start_turn(
                session.id, user_message=user_message(f"m{i}"), last_message_id=ids[-1]
            )
            for i in range(20)
        ),
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(r, AgentSessionBusy) for r in results if r is not winners[0])
    with statements(db) as seen, pytest.raises(AgentSessionBusy):
        await store.start_turn(
            session.id, user_message=user_message("again"), last_message_id=ids[-1]
        )
    assert seen == []
    await store.release(winners[0])
    lease = await store.start_turn(
        session.id, user_message=user_message("after"), last_message_id=winners[0].tail.message_id
    )
    await store.release(lease)


async def test_checkpoint_before_tail__moves_the_user_message_up_and_is_fenced(
    store: SessionStore, replica: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    lease = await store.start_turn(
        session.id, user_message=user_message("new question"), last_message_id=ids[-1]
    )
    checkpoint = user_message("<checkpoint/>")
    stored = await store.insert_checkpoint_before_tail(lease, checkpoint)
    answer = assistant_message("answer")
    await store.finish(lease, [answer])
    messages = await store.messages(session.id)
    assert [m.message_id for m in messages] == [
        *ids,
        stored.message_id,
        lease.tail.message_id,
        answer["id"],
    ]  # type: ignore[union-attr]
    assert [m.position for m in messages] == [0, 1, 2, 3, 4]

    stale = await replica.start_turn(
        session.id, user_message=user_message("q"), last_message_id=answer["id"]
    )
    await age_lock(db, session.id, 120)
    await store.start_turn(
        session.id, user_message=user_message("r"), last_message_id=stale.tail.message_id
    )  # type: ignore[union-attr]
    with pytest.raises(AgentSessionLockLost):
        await replica.insert_checkpoint_before_tail(stale, user_message("<checkpoint/>"))
    assert len(await store.messages(session.id)) == 7


async def test_messages__a_nul_anywhere_is_stored_not_refused(store: SessionStore) -> None:
    """A NUL from a model, a command or a person cannot be stored as is in PostgreSQL; the
    turn is stored with it replaced rather than lost."""
    _, session = await new_session(store)
    lease = await store.start_turn(
        session.id, user_message=user_message("before\x00after"), last_message_id=None
    )
    answer = assistant_message("a\x00b")
    answer["parts"].append({"type": "tool-shell", "output": {"stdout": "\x00\x00"}})
    await store.finish(lease, [answer])
    user, stored = await store.messages(session.id)
    assert message_text(user.message) == "before\ufffdafter"
    assert stored.message["parts"][1]["output"]["stdout"] == "\ufffd\ufffd"


async def test_tail__the_session_row_names_its_last_message_after_every_write(
    store: SessionStore, db: Database
) -> None:
    """The stale guard compares the session row's ``tail_message_id`` (migration 0011), so
    every write that appends or removes messages moves it with them: a claim with and without
    a user message, an answer, several at once, a checkpoint put before the tail, a rewind, a
    fork and an import. A write that forgot it would let a stale view through or refuse a
    current one."""

    async def agrees(session_id: int) -> str | None:
        async with db.read() as conn:
            on_row = await conn.scalar(
                select(q.SESSIONS.c.tail_message_id).where(q.SESSIONS.c.id == session_id)
            )
        tail = await store.tail(session_id)
        assert on_row == (tail.message_id if tail else None)
        return on_row

    owner, session = await new_session(store)
    assert await agrees(session.id) is None
    lease = await store.start_turn(
        session.id, user_message=user_message("question"), last_message_id=None
    )
    question = await agrees(session.id)
    assert question is not None
    await store.insert_checkpoint_before_tail(lease, user_message("<checkpoint/>"))
    assert await agrees(session.id) == question  # the question moved up, still the tail
    await store.append(lease, [assistant_message("one")])
    await agrees(session.id)
    await store.append(lease, [assistant_message("two"), assistant_message("three")])
    await agrees(session.id)
    await store.heartbeat(lease)
    await store.finish(lease, [assistant_message("answer")])
    answer = await agrees(session.id)
    lease = await store.start_turn(session.id, user_message=None, last_message_id=ANY_TAIL)
    assert await agrees(session.id) == answer  # a claim with no message leaves the tail
    await store.finish(lease)
    lease = await store.start_turn(
        session.id, user_message=user_message("again"), last_message_id=ANY_TAIL
    )
    again = await agrees(session.id)
    assert again != answer
    await store.release(lease)
    assert await agrees(session.id) == again
    await store.truncate(session.id, again, Actor(owner))  # a user target goes with what follows
    assert await agrees(session.id) == answer
    fork = await store.branch(session.id, question, user_id=owner)  # up to before the question
    await agrees(fork.session.id)
    assert await store.import_messages(fork.session.id, [(user_message("imported"), False)]) == 1
    await agrees(fork.session.id)
    lease = await store.start_turn(
        session.id, user_message=user_message("after all that"), last_message_id=answer
    )
    assert lease.tail is not None
    assert await agrees(session.id) == lease.tail.message_id


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite runs one replica: none older beside
async def test_tail__follows_the_writes_of_a_replica_that_knows_nothing_of_it(
    store: SessionStore, db: Database
) -> None:
    """Through a rolling upgrade, replicas of the previous release append and rewind without
    moving ``tail_message_id``; PostgreSQL's triggers (migration 0011) move it for them. So a
    client whose view such an answer moved on is still refused as stale, and one that saw a
    rewind made there is admitted. And for this code's own writes they stay idle: the column
    it moved is what they would have set."""

    _, session = await new_session(store)
    seen = await add_exchange(store, session.id, 1)
    # An older replica's turn: its question and answer, written as its code wrote them, on a
    # connection that does not say it keeps the tail (this code's connections do).
    async with as_an_older_replica(db) as conn:
        older = await q.append_messages(
            conn,
            session.id,
            2,
            [(user_message("older question"), False), (assistant_message("older answer"), False)],
        )
    assert await tail_on_row(db, session.id) == older[-1].message_id
    with pytest.raises(AgentSessionStale) as stale:
        await store.start_turn(
            session.id, user_message=user_message("late"), last_message_id=seen[-1]
        )
    assert stale.value.actual_last_message_id == older[-1].message_id
    # And its rewind to before them: the tail is what the client saw again.
    await rewind_as_an_older_replica(db, session.id, 2)
    assert await tail_on_row(db, session.id) == seen[-1]
    lease = await store.start_turn(
        session.id, user_message=user_message("now"), last_message_id=seen[-1]
    )
    await store.release(lease)
    assert lease.tail is not None
    # On this code's connections the triggers do not fire: a bare append (which this code
    # never makes) leaves the column where the claim put it.
    async with db.write() as conn:
        await q.append_messages(conn, session.id, 3, [(assistant_message("bare"), False)])
    assert await tail_on_row(db, session.id) == lease.tail.message_id
