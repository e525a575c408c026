"""Truncate (rewind), branch (fork) and the history projection, on both databases."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import event, select, text, update

from core.errors import (
    AgentSessionBusy,
    AgentSessionForbidden,
    AgentSessionLockLost,
    AgentSessionNotFound,
    AgentSessionStale,
    DatabaseError,
    MessageNotFound,
)
from core.messages import assistant_message, user_message
from core.records import ANY_TAIL, Actor, BranchResult, StoredMessage
from core.storage import engine, transcript
from core.storage import queries as q
from core.storage.deliveries import Deliveries
from core.storage.dialect import ago
from core.storage.engine import Database, json_loads
from core.storage.models import (
    AgentSessionSnapshot,
    SnapshotContent,
    SnapshotSet,
    SnapshotSetMember,
)
from core.storage.queries import history_statement
from core.storage.retention import RetentionPolicy
from core.storage.sessions import TAKEOVER_MARK, SessionStore
from core.storage.sweeper import sweep
from tests.helpers import add_exchange, age_lock, new_session, statements


async def texts(store: SessionStore, session_id: int) -> list[str]:
    return [m.message["parts"][0]["text"] for m in await store.messages(session_id)]


# -- truncate ---------------------------------------------------------------------------------


async def test_truncate__user_target_is_removed_with_what_follows_and_returned_as_draft(
    store: SessionStore,
) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 3)
    result = await store.truncate(session.id, ids[2], Actor(owner))
    assert result.draft == "question 1"
    assert result.deleted == 4
    assert result.deleted_message_ids == tuple(ids[2:])
    assert result.tail_message_id == ids[1]
    assert await texts(store, session.id) == ["question 0", "answer 0"]


async def test_truncate__assistant_target_is_kept(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 3)
    result = await store.truncate(session.id, ids[3], Actor(owner))
    assert result.draft is None
    assert result.tail_message_id == ids[3]
    assert await texts(store, session.id) == ["question 0", "answer 0", "question 1", "answer 1"]
    # The next turn continues from the new tail, at the next position.
    lease = await store.start_turn(
        session.id, user_message=user_message("again"), last_message_id=ids[3]
    )
    assert lease.tail is not None
    assert lease.tail.position == 4
    await store.release(lease)


async def test_truncate__refused_while_a_turn_is_active(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 2)
    lease = await store.start_turn(
        session.id, user_message=user_message("q"), last_message_id=ids[-1]
    )
    with pytest.raises(AgentSessionBusy):
        await store.truncate(session.id, ids[0], Actor(owner))
    assert len(await store.messages(session.id)) == 5
    await store.release(lease)


async def test_truncate__foreign_user_is_forbidden_and_nothing_changes(store: SessionStore) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id, 2)
    stranger = await store.get_or_create_user("slack:T1:U999")
    with pytest.raises(AgentSessionForbidden) as refused:
        await store.truncate(session.id, ids[0], Actor(stranger))
    assert refused.value.code == "agent_session_forbidden"
    assert len(await store.messages(session.id)) == 4
    admin = await store.truncate(session.id, ids[2], Actor(stranger, admin=True))
    assert admin.deleted == 2


async def test_truncate__unknown_session_or_message_is_refused(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    with pytest.raises(AgentSessionNotFound):
        await store.truncate(987_654, ids[0], Actor(owner))
    _, other = await new_session(store, key="T1/C1/other")
    other_ids = await add_exchange(store, other.id)
    with pytest.raises(MessageNotFound):
        await store.truncate(session.id, other_ids[0], Actor(owner, admin=True))
    assert len(await store.messages(session.id)) == 2


async def test_truncate__at_a_checkpoint_keeps_it_and_returns_no_draft(
    store: SessionStore,
) -> None:
    # A checkpoint is user-role but nobody wrote it: rewinding at it goes back to just after
    # that compaction (like an assistant message), and no "<checkpoint>" text comes back.
    owner, session = await new_session(store)
    await add_exchange(store, session.id)
    cp = await checkpoint(store, session.id, "one")
    after = await add_exchange(store, session.id)
    result = await store.truncate(session.id, cp, Actor(owner))
    assert result.draft is None
    assert result.deleted == 2
    assert result.deleted_message_ids == tuple(after)
    assert result.tail_message_id == cp
    assert [m.message_id for m in await store.history(session.id)] == [cp]


async def test_truncate__before_a_checkpoint_falls_back_to_the_previous_one(
    store: SessionStore,
) -> None:
    # Undoing a compaction: rewind to the message before its checkpoint.
    owner, session = await new_session(store)
    await add_exchange(store, session.id)
    first = await checkpoint(store, session.id, "first")
    before_second = await add_exchange(store, session.id)
    second = await checkpoint(store, session.id, "second")
    ids_after = await add_exchange(store, session.id)
    assert (await store.history(session.id))[0].message_id == second
    result = await store.truncate(session.id, before_second[-1], Actor(owner))
    assert result.draft is None
    history = await store.history(session.id)
    assert history[0].message_id == first
    assert second not in [m.message_id for m in history]
    assert ids_after[0] not in [m.message_id for m in history]


@pytest.mark.parametrize("backend", ["postgresql"])  # only there: see below
async def test_truncate__a_turn_released_while_the_rewind_starts_cannot_shift_the_cut(
    store: SessionStore, replica: SessionStore, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race of READ COMMITTED: the rewind reads its target, then a turn on another replica
    # auto-compacts (its user message moves up one position), answers and releases, then the
    # rewind takes the lock. The rewind must cut at where the target is now. On SQLite the
    # write transaction excludes the turn's writes, so the interleaving cannot be built there.
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    lease = await replica.start_turn(
        session.id, user_message=user_message("the question"), last_message_id=ids[-1]
    )
    assert lease.tail is not None
    question = lease.tail.message_id
    finished: list[str] = []

    async def finish_turn() -> None:
        if finished:
            return
        stored = await replica.insert_checkpoint_before_tail(lease, user_message("<checkpoint/>"))
        await replica.finish(lease, [assistant_message("the answer")])
        finished.append(stored.message_id)

    original = q.message_in

    async def read_then_let_the_turn_finish(*args: object) -> StoredMessage:
        found = await original(*args)  # type: ignore[arg-type]
        await finish_turn()  # another connection: commits while the rewind's transaction runs
        return found

    monkeypatch.setattr(q, "message_in", read_then_let_the_turn_finish)
    try:
        result = await store.truncate(session.id, question, Actor(owner))
    except AgentSessionBusy:  # locked before reading: the running turn refused the rewind
        await finish_turn()
        result = await store.truncate(session.id, question, Actor(owner))
    assert result.draft == "the question"
    assert [m.message_id for m in await store.messages(session.id)] == [*ids, finished[0]]
    assert (await store.history(session.id))[0].message_id == finished[0]


async def copy_of(
    store: SessionStore, source_id: int, fork: BranchResult, source_ids: list[str]
) -> list[str]:
    """The ids the fork gave these source messages: the copy keeps each one's position."""
    source = {m.message_id: m.position for m in await store.messages(source_id)}
    copied = {m.position: m.message_id for m in await store.messages(fork.session.id)}
    return [copied[source[i]] for i in source_ids]


async def checkpoint(store: SessionStore, session_id: int, label: str) -> str:
    lease = await store.start_turn(
        session_id,
        user_message=None,
        last_message_id=(await store.tail(session_id)).message_id,  # type: ignore[union-attr]
    )
    (stored,) = await store.append(lease, [user_message(f"checkpoint {label}")], compaction=True)
    await store.release(lease)
    return stored.message_id


# -- branch -----------------------------------------------------------------------------------


async def test_branch__assistant_target_copies_through_it_with_new_ids(store: SessionStore) -> None:
    _owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 3)
    forker = await store.get_or_create_user("slack:T1:U2")
    result = await store.branch(session.id, ids[3], user_id=forker)
    copied = await store.messages(result.session.id)
    assert [m.message["parts"][0]["text"] for m in copied] == [
        "question 0",
        "answer 0",
        "question 1",
        "answer 1",
    ]
    new_ids = [m.message_id for m in copied]
    assert not set(new_ids) & set(ids)
    assert all(m.message["id"] == m.message_id for m in copied)
    assert [m.position for m in copied] == [0, 1, 2, 3]
    # Version 7 UUIDs in canonical form, distinct, as a message written from Python has.
    assert all(str(uuid.UUID(i)) == i and uuid.UUID(i).version == 7 for i in new_ids)
    assert len(set(new_ids)) == 4
    assert result.draft is None
    assert result.session.user_id == forker
    assert result.session.title == (await store.get_session(session.id)).title
    assert await texts(store, session.id) == [
        "question 0",
        "answer 0",
        "question 1",
        "answer 1",
        "question 2",
        "answer 2",
    ]


async def test_branch__copies_each_document_whole_whatever_its_key_order(
    store: SessionStore, db: Database, backend: str
) -> None:
    """PostgreSQL stores a message as its text and a fork rewrites the id where a stored
    message has it (first); a document whose keys come in another order is copied as well."""
    _owner, session = await new_session(store)
    first = assistant_message("id first", note={"id": "x", "n": [1, 2.5, "é"]})
    shuffled: dict[str, Any] = {"parts": [{"type": "text", "text": "id last"}], "role": "assistant"}
    shuffled["id"] = first["id"][:-1] + ("0" if first["id"][-1] != "0" else "1")
    await store.import_messages(session.id, [(first, False), (shuffled, False)])
    originals = await store.messages(session.id)
    fork = await store.branch(session.id, shuffled["id"], user_id=None)
    copied = await store.messages(fork.session.id)
    assert [m.message for m in copied] == [
        {**m.message, "id": c.message_id} for m, c in zip(originals, copied, strict=True)
    ]
    assert all(c.message_id not in (first["id"], shuffled["id"]) for c in copied)
    if backend == "postgresql":  # the text is kept as written, the id replaced where it stands
        async with db.read() as conn:
            rows = await conn.execute(
                text("SELECT message_id, message::text FROM agent_session_messages")
            )
            stored = {str(row["message_id"]): str(row["message"]) for row in rows.mappings()}
        assert stored[copied[0].message_id] == stored[first["id"]].replace(
            first["id"], copied[0].message_id
        )


async def test_branch__user_target_stops_before_it_and_returns_draft(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 2)
    result = await store.branch(session.id, ids[2], user_id=owner)
    assert result.draft == "question 1"
    assert [m.message["parts"][0]["text"] for m in await store.messages(result.session.id)] == [
        "question 0",
        "answer 0",
    ]


async def test_branch__at_a_checkpoint_starts_from_it_with_no_draft(
    store: SessionStore,
) -> None:
    owner, session = await new_session(store)
    await add_exchange(store, session.id)
    cp = await checkpoint(store, session.id, "one")
    await add_exchange(store, session.id)
    result = await store.branch(session.id, cp, user_id=owner)
    assert result.draft is None
    assert result.copied == 3
    history = await store.history(result.session.id)
    assert [m.message_id for m in history] == [(await copy_of(store, session.id, result, [cp]))[0]]
    assert history[0].is_compaction_message


async def test_branch__allowed_while_source_is_busy(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 2)
    lease = await store.start_turn(
        session.id, user_message=user_message("busy"), last_message_id=ids[-1]
    )
    result = await store.branch(session.id, ids[-1], user_id=owner)
    assert result.copied == 4
    assert not result.session.is_turn_active
    assert await store.is_turn_active(session.id)
    await store.release(lease)


async def test_branch__carries_checkpoint_flag_model_and_snapshots(
    store: SessionStore, db: Database
) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    cp = await checkpoint(store, session.id, "one")
    more = await add_exchange(store, session.id)
    positions = {m.message_id: m.position for m in await store.messages(session.id)}
    async with db.write() as conn:
        content_id = (
            await conn.execute(
                SnapshotContent.__table__.insert().values(
                    digest="ab" * 32, codec="zstd", raw_size=3, stored_size=3, data=b"abc"
                )
            )
        ).inserted_primary_key[0]
        set_id = (
            await conn.execute(SnapshotSet.__table__.insert().values(digest="cd" * 32, size=1))
        ).inserted_primary_key[0]
        await conn.execute(
            SnapshotSetMember.__table__.insert().values(set_id=set_id, content_id=content_id)
        )
        await conn.execute(
            AgentSessionSnapshot.__table__.insert(),
            [
                {
                    "message_id": m,
                    "session_id": session.id,
                    "position": positions[m],
                    "content_digest": "ab" * 32,
                    "base_set_id": set_id,
                    "raw_size": 3,
                    "stored_size": 3,
                }
                for m in (ids[1], more[1])
            ],
        )
    result = await store.branch(session.id, more[1], user_id=owner)
    history = await store.history(result.session.id)
    assert history[0].is_compaction_message
    assert history[0].message_id == (await copy_of(store, session.id, result, [cp]))[0]
    async with db.read() as conn:
        rows = (
            await conn.execute(
                AgentSessionSnapshot.__table__.select().where(
                    AgentSessionSnapshot.__table__.c.session_id == result.session.id
                )
            )
        ).all()
    assert sorted(r.message_id for r in rows) == sorted(
        await copy_of(store, session.id, result, [ids[1], more[1]])
    )
    assert {(r.content_digest, r.base_set_id) for r in rows} == {("ab" * 32, set_id)}


async def fake_snapshots(db: Database, session_id: int, message_ids: list[str]) -> None:
    """Snapshot rows (one shared set of one object) for these messages."""
    async with db.read() as conn:
        found = await conn.execute(
            select(q.MESSAGES.c.message_id, q.MESSAGES.c.position).where(
                q.MESSAGES.c.message_id.in_(message_ids)
            )
        )
        positions = {r.message_id: r.position for r in found}
    async with db.write() as conn:
        content_id = (
            await conn.execute(
                SnapshotContent.__table__.insert().values(
                    digest="ef" * 32, codec="zstd", raw_size=3, stored_size=3, data=b"abc"
                )
            )
        ).inserted_primary_key[0]
        set_id = (
            await conn.execute(SnapshotSet.__table__.insert().values(digest="12" * 32, size=1))
        ).inserted_primary_key[0]
        await conn.execute(
            SnapshotSetMember.__table__.insert().values(set_id=set_id, content_id=content_id)
        )
        await conn.execute(
            AgentSessionSnapshot.__table__.insert(),
            [
                {
                    "message_id": m,
                    "session_id": session_id,
                    "position": positions[m],
                    "content_digest": "ef" * 32,
                    "base_set_id": set_id,
                    "raw_size": 3,
                    "stored_size": 3,
                }
                for m in message_ids
            ],
        )


@pytest.mark.parametrize("backend", ["postgresql"])  # only there: see below
async def test_branch__a_rewind_of_the_source_during_the_fork_cannot_split_its_reads(
    store: SessionStore,
    replica: SessionStore,
    db: Database,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fork reads its source in several statements; a rewind of the source committing on
    # another connection between them must not leave copied rows without their snapshots or
    # a wrong count. On SQLite the fork's write transaction excludes the rewind.
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 3)
    await fake_snapshots(db, session.id, [ids[1], ids[3], ids[5]])
    original = transcript._copy_snapshots
    rewound: list[int] = []

    async def rewind_then_copy(*args: Any) -> None:
        if not rewound:
            result = await replica.truncate(session.id, ids[1], Actor(owner))
            rewound.append(result.deleted)
        await original(*args)

    monkeypatch.setattr(transcript, "_copy_snapshots", rewind_then_copy)
    result = await store.branch(session.id, ids[5], user_id=owner)
    assert rewound == [4]  # the rewind did commit in the middle of the fork
    copied = await store.messages(result.session.id)
    assert result.copied == len(copied) == 6
    assert [m.message["parts"][0]["text"] for m in copied] == [
        f"{kind} {i}" for i in range(3) for kind in ("question", "answer")
    ]
    async with db.read() as conn:
        with_state = set(
            (
                await conn.execute(
                    select(AgentSessionSnapshot.__table__.c.message_id).where(
                        AgentSessionSnapshot.__table__.c.session_id == result.session.id
                    )
                )
            ).scalars()
        )
    assert with_state == {copied[p].message_id for p in (1, 3, 5)}


async def test_branch__unknown_session_or_message(store: SessionStore) -> None:
    owner, session = await new_session(store)
    await add_exchange(store, session.id)
    with pytest.raises(AgentSessionNotFound):
        await store.branch(424_242, "00000000-0000-4000-8000-000000000000", user_id=owner)
    with pytest.raises(MessageNotFound):
        await store.branch(session.id, "00000000-0000-4000-8000-000000000000", user_id=owner)
    assert len(await store.list_sessions()) == 1


# -- projection -------------------------------------------------------------------------------


async def test_history__is_latest_checkpoint_and_after(store: SessionStore) -> None:
    _, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    await checkpoint(store, session.id, "old")
    await add_exchange(store, session.id, 2)
    latest = await checkpoint(store, session.id, "new")
    after = await add_exchange(store, session.id, 1)
    history = await store.history(session.id)
    assert [m.message_id for m in history] == [latest, *after]
    assert history[0].is_compaction_message


async def test_history__without_checkpoint_is_everything(store: SessionStore) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id, 3)
    assert [m.message_id for m in await store.history(session.id)] == ids


@pytest.mark.parametrize("watched", [False, True], ids=["on the driver", "through SQLAlchemy"])
async def test_history__the_same_on_the_drivers_path_and_sqlalchemys(
    store: SessionStore, db: Database, watched: bool
) -> None:
    """Unwatched, a history load runs on the driver itself (SQLite's cursor, asyncpg) and
    decodes the JSON with orjson; watched, SQLAlchemy's way. The same messages either way,
    down to the last character, the checkpoint flag and the ids."""
    _, session = await new_session(store)
    await add_exchange(store, session.id, 1)
    latest = await checkpoint(store, session.id, "é \u2028 ✓ \U0001f600")
    odd = assistant_message('quotes " \\ and \ud7ff and \x7f', tool={"n": [1, 2.5, None, True]})
    await store.import_messages(session.id, [(odd, False)])
    if watched:
        with statements(db) as seen:
            history = await store.history(session.id)
        assert seen
    else:
        history = await store.history(session.id)
    assert [m.message_id for m in history] == [latest, odd["id"]]
    assert [m.position for m in history] == [2, 3]
    assert [m.is_compaction_message for m in history] == [True, False]
    assert history[0].message["parts"][0]["text"] == "checkpoint é \u2028 ✓ \U0001f600"
    assert history[1].message == odd
    assert all(type(m.is_compaction_message) is bool for m in history)


async def test_history__leaves_the_garbage_collector_as_it_found_it(store: SessionStore) -> None:
    _, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    assert gc.isenabled()
    await store.history(session.id)
    assert gc.isenabled()
    gc.disable()
    try:
        await store.history(session.id)
        assert not gc.isenabled()  # paused by someone else: not turned back on
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", ["sqlite"])  # PostgreSQL's JSONB refuses NaN and Infinity
async def test_history__reads_back_what_orjson_refuses(
    store: SessionStore, db: Database, backend: str
) -> None:
    """The standard library writes NaN, Infinity and lone surrogates; orjson refuses them, so
    their messages are read by the standard library instead, and still come back."""
    _, session = await new_session(store)
    message = assistant_message("odd numbers", score=float("inf"), bad="\ud800")
    await store.import_messages(session.id, [(message, False)])
    (stored,) = await store.history(session.id)
    assert stored.message["metadata"]["score"] == float("inf")
    assert stored.message["metadata"]["bad"] == "\ud800"
    assert json_loads("[NaN]")[0] != json_loads("[NaN]")[0]


@pytest.mark.parametrize("backend", ["postgresql"])  # asyncpg's own path
async def test_history__a_connection_lost_mid_load_is_a_database_error_and_not_pooled(
    store: SessionStore, db: Database, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL the load runs on asyncpg itself, on a connection held outside any
    transaction (``Database.autocommit``): a connection that dies under it is reported as a
    ``DatabaseError`` (never a driver exception) and is not handed out again.

    A held connection whose end the process has already read is never used (``engine.
    _ended_by_server``; ``tests/test_prepared.py``); one that ends between that look and the
    statement is what this is about, so the look is made blind here: otherwise whether the
    load meets the dead connection depends on whether the loop read its end first."""
    monkeypatch.setattr(engine, "_ended_by_server", lambda held: False)
    _, session = await new_session(store)
    await add_exchange(store, session.id, 1)
    async with db.autocommit() as held:  # the one held connection: the next load's
        pid = int(await held.scalar(text("SELECT pg_backend_pid()")))
    async with db.read() as other:  # and wait until its server process is gone
        assert await other.scalar(text(f"SELECT pg_terminate_backend({pid}, 10000)"))

    with pytest.raises(DatabaseError):
        await store.history(session.id)
    assert len(await store.history(session.id)) == 2


async def long_session(store: SessionStore, total: int, tail_after_checkpoint: int) -> int:
    _, session = await new_session(store)
    body = [
        (user_message(f"m{i}") if i % 2 == 0 else assistant_message(f"m{i}"), False)
        for i in range(total - tail_after_checkpoint - 1)
    ]
    body.append((user_message("the checkpoint"), True))
    body += [(assistant_message(f"t{i}"), False) for i in range(tail_after_checkpoint)]
    await store.import_messages(session.id, body)
    return session.id


async def test_history__cost_follows_projection_not_history(
    store: SessionStore, db: Database
) -> None:
    """Same statements and rows for a 40-message and a 3,000-message history.

    One query, and every row it returns is projected; the plan check below shows the database
    itself seeks by index instead of scanning the session's history.
    """
    small = await long_session(store, 40, 5)
    large = await long_session(store, 3000, 5)
    with statements(db) as small_sql:
        small_history = await store.history(small)
    with statements(db) as large_sql:
        large_history = await store.history(large)
    assert len(small_history) == len(large_history) == 6
    assert [s for s, _ in small_sql] == [s for s, _ in large_sql]
    assert len([s for s, _ in large_sql if s.lstrip().upper().startswith("SELECT")]) == 1


async def test_history__query_plan_uses_indexes(store: SessionStore, db: Database) -> None:
    session_id = await long_session(store, 3000, 5)
    query = str(
        history_statement(session_id).compile(
            dialect=db.sync_engine.dialect, compile_kwargs={"literal_binds": True}
        )
    )
    async with db.read() as conn:
        if db.dialect == "sqlite":
            rows = await conn.execute(text(f"EXPLAIN QUERY PLAN {query}"))
            plan = " | ".join(str(r[-1]) for r in rows)
            assert "SCAN" not in plan, plan
            assert plan.count("USING") >= 2, plan
        else:
            await conn.execute(text("ANALYZE agent_session_messages"))
            rows = await conn.execute(text(f"EXPLAIN (FORMAT JSON) {query}"))
            plan = json.dumps(rows.scalar())
            assert "Seq Scan" not in plan, plan
            assert "Index" in plan, plan


@pytest.mark.parametrize("backend", ["sqlite"])  # only there: see below
async def test_sqlite__the_store_uses_no_syntax_newer_than_the_oldest_supported(
    store: SessionStore,
    replica: SessionStore,
    db: Database,
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The SQL is written for core.storage.engine.MIN_SQLITE (verified against that library by hand):
    # no MATERIALIZED (3.35), no HAVING without GROUP BY (3.39), and RETURNING (3.35) only where
    # SQLAlchemy's dialect says the library has it. Here the dialect says what it says for a SQLite
    # older than 3.35, and the turn's other way (read back in the same transaction) must do
    # everything: a turn, a stale refusal, a takeover.
    for flag in ("insert_returning", "update_returning", "delete_returning"):
        for database in (db, replica.db):
            monkeypatch.setattr(database.sync_engine.dialect, flag, False)
    with statements(db) as seen, statements(replica.db) as seen_by_replica:
        owner, session = await new_session(store)
        ids = await add_exchange(store, session.id, 2)
        with pytest.raises(AgentSessionStale):
            await store.start_turn(
                session.id, user_message=user_message("late"), last_message_id=ids[0]
            )
        stalled = await store.start_turn(
            session.id, user_message=user_message("stalls"), last_message_id=ids[-1]
        )
        await age_lock(db, session.id, 61)
        taken = await replica.start_turn(session.id, user_message=None, last_message_id=ANY_TAIL)
        assert taken.token.startswith(TAKEOVER_MARK)
        assert taken.token != stalled.token
        assert taken.tail is not None
        assert taken.tail.message_id == stalled.tail.message_id
        await replica.finish(taken, [assistant_message("answered by the next turn")])
        with pytest.raises(AgentSessionLockLost):
            await store.finish(stalled, [assistant_message("too late")])
        ids = [m.message_id for m in await store.history(session.id)]
        await checkpoint(store, session.id, "one")
        await store.import_messages(session.id, [(assistant_message("imported"), False)])
        await store.branch(session.id, ids[1], user_id=owner)
        await store.truncate(session.id, ids[2], Actor(owner))
        await store.get_or_create_session("slack", "T1/C1/again", user_id=owner)
        # Delivery records: a burst's group commit (a duplicate in it) and a state change.
        deliveries = Deliveries(db, "slack")
        recorded = await asyncio.gather(
            *(
                deliveries.record(
                    event_key=key,
                    thread_key="T1/C1/1",
                    author="U1",
                    message_id=str(uuid.uuid4()),
                    text=key,
                    context={},
                )
                for key in ("T1/C1/1", "T1/C1/2", "T1/C1/1")
            )
        )
        assert [r.event_key if r else None for r in recorded] == ["T1/C1/1", "T1/C1/2", None]
        assert recorded[0] is not None
        moved = await deliveries.move(
            recorded[0].id, ("received",), "started", session_id=session.id
        )
        assert moved is not None
        assert moved.state == "started"
    sql = [" ".join(s.upper().split()) for s, _ in seen + seen_by_replica]
    assert sql
    assert not [s for s in sql if " RETURNING " in s or "MATERIALIZED" in s]
    assert not [s for s in sql if " HAVING " in s and " GROUP BY " not in s]


@pytest.mark.parametrize("backend", ["sqlite"])  # only there: see below
async def test_sqlite__operations_that_grow_with_the_data_run_off_the_event_loop(
    store: SessionStore, db: Database, backend: str
) -> None:
    # SQLite statements otherwise run on the loop (no aiosqlite hop on the hot path): a fork,
    # an import and the sweeper's batches must not hold it for their whole length.
    loop_thread = threading.get_ident()
    on_loop: dict[str, set[bool]] = {}

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        words = " ".join(statement.upper().split()[:3])
        on_loop.setdefault(words, set()).add(threading.get_ident() == loop_thread)

    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id, 3)
    event.listen(db.sync_engine, "before_cursor_execute", record)
    try:
        await store.branch(session.id, ids[-1], user_id=owner)
        await store.import_messages(session.id, [(assistant_message("imported"), False)])
        await store.truncate(session.id, ids[2], Actor(owner))
        temporary, _ = await store.get_or_create_session(
            "slack", "T1/C1/temporary", user_id=owner, temporary=True
        )
        async with db.write() as conn:
            await conn.execute(
                update(q.SESSIONS).where(q.SESSIONS.c.id == temporary.id).values(expires_at=ago(10))
            )
        await sweep(db, RetentionPolicy(0, 0), staleness_seconds=60)
        await add_exchange(store, session.id)
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", record)
    assert on_loop["INSERT INTO AGENT_SESSION_MESSAGES"] >= {False}  # fork copy, import
    assert on_loop["DELETE FROM AGENT_SESSIONS"] == {False}  # sweeper batch
    assert on_loop["UPDATE AGENT_SESSIONS SET"] >= {True}  # a turn's claim stays inline
