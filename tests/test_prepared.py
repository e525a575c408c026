"""``core.storage.prepared``: a hot-path statement gives the same result whichever way it runs.

With nobody watching the engine it runs on the driver itself (SQLite's cursor, or asyncpg
inside SQLAlchemy's transaction); watched (here: a statement listener), it goes SQLAlchemy's
ordinary way. Both ways must bind the same values (JSON, literals compiled into the statement,
NULLs), read the same rows (JSON decoded, UTC datetimes) and report a constraint failure as
the same SQLAlchemy error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from core.errors import DatabaseError, DuplicateMessage
from core.messages import assistant_message, user_message
from core.records import ANY_TAIL
from core.storage import engine
from core.storage import queries as q
from core.storage.deliveries import Deliveries
from core.storage.dialect import json_ids
from core.storage.engine import Database, InlineConnection, create_database
from core.storage.sessions import _STOPS, SessionStore
from core.storage.surface_state import SurfaceState
from tests.helpers import new_session, statements


async def _turn_by_prepared_statements(
    db: Database, session_id: int, text: str, last: str | None
) -> tuple[str | None, int | None, bool, bool]:
    """A stale-guarded claim, its user message's insert, a fence and a release, through
    ``core.storage.queries``."""
    token = f"token-{text}"
    async with db.write() as conn:
        params = {"sid": session_id, "token": token, "takeover_token": "t" + token}
        message = user_message(f"{text} \x00 é")
        row = q.message_row(session_id, 0, message)
        claim = {
            **params,
            **q.user_params(row),
            "staleness": 60.0,
            "title": text,
            "abandoned": None,
            "any_tail": False,
            "last": last,
        }
        claimed = await q.claim(conn, claim, stamp=False)
        position = await q.insert_next(conn, row) if claimed is not None else None
    async with db.write() as conn:
        fenced = await q.fence(conn, {"sid": session_id, "token": token}, release=True)
        again = await q.fence(conn, {"sid": session_id, "token": token}, release=True)
    return claimed, position, fenced, again


@pytest.mark.parametrize("watched", [False, True], ids=["unwatched", "watched"])
async def test_prepared__the_same_turn_either_way(
    store: SessionStore, db: Database, backend: str, watched: bool
) -> None:
    _, session = await new_session(store)
    if watched:
        with statements(db) as seen:
            got = await _turn_by_prepared_statements(db, session.id, "first", None)
        assert any(s.startswith("UPDATE agent_sessions") for s, _ in seen)
    else:
        got = await _turn_by_prepared_statements(db, session.id, "first", None)
    assert got == ("token-first", 0, True, False)  # the second release finds no lock
    (stored,) = await store.history(session.id)
    assert stored.message["parts"][0]["text"] == "first \ufffd é"  # NUL replaced, JSON intact
    info = await store.get_session(session.id)
    assert info.title == "first"
    assert not info.is_turn_active
    assert info.heartbeat_at is None
    # The stale guard: a claim whose tail is not the one seen changes nothing.
    assert await _turn_by_prepared_statements(db, session.id, "late", "not-the-tail") == (
        None,
        None,
        False,
        False,
    )
    assert [m.message_id for m in await store.history(session.id)] == [stored.message_id]


@pytest.mark.parametrize("backend", ["sqlite"])  # the driver's cursor is SQLite's path only
async def test_prepared__unwatched_sqlite_runs_the_compiled_sql_on_the_cursor(
    store: SessionStore, db: Database, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, session = await new_session(store)

    async def not_this_way(*_args: Any) -> Any:
        raise AssertionError("an unwatched hot-path statement went through SQLAlchemy")

    traced: list[str] = []
    async with db.write() as conn:
        assert type(conn) is InlineConnection
        monkeypatch.setattr(conn, "execute", not_this_way)
        raw = conn.sync_connection.connection.dbapi_connection
        raw.set_trace_callback(traced.append)  # SQLite's own record of what it ran
        try:
            fenced = await q.fence(conn, {"sid": session.id, "token": "none"}, release=False)
        finally:
            raw.set_trace_callback(None)
    assert fenced is False  # no such token: nothing changed
    compiled = str(q.FENCE[False].statement.compile(dialect=db.sync_engine.dialect))
    assert len(traced) == 1
    assert " ".join(traced[0].split()).startswith(" ".join(compiled.split()).split("?")[0])


@pytest.mark.parametrize("backend", ["sqlite"])  # the reader connection is SQLite's path only
async def test_prepared__a_one_statement_read_runs_on_the_reader_outside_any_transaction(
    store: SessionStore, db: Database, backend: str
) -> None:
    """``Prepared.fetch`` on SQLite: the statement alone on the process's reader connection
    (no BEGIN, no ROLLBACK), seeing what other connections committed just before; a reader
    that failed is replaced, and the failure reaches the caller as a ``DatabaseError``."""
    surface = SurfaceState(db, "slack")
    assert await surface.get_thread("T1/C1/1.0") is None
    with db.sqlite_reader() as reader:
        traced: list[str] = []
        reader.set_trace_callback(traced.append)
    _, session = await new_session(store)
    await surface.bind_thread("T1/C1/1.0", session.id)  # binds on the writer connection
    await surface.set_shown(session.id, "m-1")
    try:
        found = await surface.get_thread("T1/C1/1.0")
    finally:
        reader.set_trace_callback(None)
    assert found is not None
    assert (found.session_id, found.last_shown_message_id) == (session.id, "m-1")
    reads = [t for t in traced if "surface_threads" in t]
    assert reads
    assert all(t.lstrip().startswith("SELECT") for t in traced)  # no BEGIN, no ROLLBACK
    assert not reader.in_transaction

    reader.close()  # under the reader: as a connection that broke
    with pytest.raises(DatabaseError, match="closed"):
        await surface.get_thread("T1/C1/1.0")
    again = await surface.get_thread("T1/C1/1.0")
    assert again == found
    with db.sqlite_reader() as replaced:
        assert replaced is not reader


@pytest.mark.parametrize("backend", ["sqlite"])  # PostgreSQL's is a held connection (below)
async def test_prepared__a_watched_one_statement_read_on_sqlite_takes_no_write_lock(
    store: SessionStore, db: Database, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watched, ``Prepared.fetch`` on SQLite goes SQLAlchemy's way in a read transaction,
    never in a write (SQLite's ``autocommit`` is one), so it waits on no writer."""
    surface = SurfaceState(db, "slack")
    _, session = await new_session(store)
    await surface.bind_thread("T1/C1/2.0", session.id)

    def no_write(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a read took SQLite's write lock")

    monkeypatch.setattr(db, "write", no_write)
    with statements(db) as seen:
        found = await surface.get_thread("T1/C1/2.0")
    assert found is not None
    assert found.session_id == session.id
    assert any("surface_threads" in sql for sql, _ in seen)


async def held_backend_pid(db: Database, pause: float = 0.0) -> int:
    """The server process a statement of its own ran on (``Database.autocommit``), after
    ``pause`` seconds in it."""
    async with db.autocommit() as conn:
        return int(
            await conn.scalar(text("SELECT pg_backend_pid() FROM pg_sleep(:s)"), {"s": pause})
        )


@pytest.mark.parametrize("backend", ["postgresql"])  # held connections are PostgreSQL's path only
async def test_prepared__statements_of_their_own_run_on_held_connections_outside_transactions(
    db: Database, backend: str
) -> None:
    """``Database.autocommit`` on PostgreSQL: a few connections held open outside any
    transaction and used again (the same server process); what a statement writes is
    committed as it returns; a statement that fails or is cancelled midway gives its connection
    back to the pool, and the next one runs; more users at once than held connections all run,
    the others on pooled connections."""

    backend_pid = functools.partial(held_backend_pid, db)

    first = await backend_pid()
    assert await backend_pid() == first

    async with db.autocommit() as conn:
        await conn.execute(text("INSERT INTO users (external_id) VALUES ('held-1')"))
        async with db.read() as other:  # another connection sees it at once: committed
            found = "SELECT count(*) FROM users WHERE external_id = 'held-1'"
            assert await other.scalar(text(found)) == 1

    with pytest.raises(DatabaseError, match="division by zero"):
        async with db.autocommit() as conn:
            await conn.execute(text("SELECT 1 / 0"))
    async with asyncio.timeout(30):
        await backend_pid()

    sleeping = asyncio.create_task(backend_pid(pause=30))
    await asyncio.sleep(0.5)
    sleeping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sleeping
    async with asyncio.timeout(30):  # not behind the cancelled statement
        await backend_pid()

    more = db.held_at_most + 3  # held ones, and pooled ones once all are busy: never a queue
    at_once = await asyncio.gather(*(backend_pid(pause=0.3) for _ in range(more)))
    assert len(set(at_once)) == more


@pytest.mark.parametrize("backend", ["postgresql"])
async def test_prepared__held_connections_the_server_ended_are_never_used(
    db: Database, backend: str
) -> None:
    """A restart or a failover ends every connection while the process holds them idle: no
    statement after it may fail on one (before, each held connection failed one statement),
    nor on an idle pooled connection the server ended too."""

    backend_pid = functools.partial(held_backend_pid, db)

    more = db.held_at_most + 3  # every held connection, and pooled ones, opened
    pids = set(await asyncio.gather(*(backend_pid(pause=0.3) for _ in range(more))))
    assert len(pids) == more
    admin = create_database(db.url)
    try:
        async with admin.autocommit() as conn:
            ended = await conn.scalar(
                text(
                    "SELECT count(*) FROM unnest(CAST(:pids AS int[])) p(pid) "
                    "WHERE pg_terminate_backend(pid)"
                ),
                {"pids": sorted(pids)},
            )
        assert ended == more
    finally:
        await admin.dispose()
    # Until this process has read the server's end of each held connection (a poll, not a
    # synchronising sleep): what a restart long before the next statement leaves.
    async with asyncio.timeout(30):
        while True:
            if all(engine._ended_by_server(held) for held in db._held):
                break
            await asyncio.sleep(0.05)
    assert [await backend_pid() for _ in range(more + 5)]  # none raised
    assert await backend_pid() not in pids


async def test_prepared__a_constraint_failure_is_sqlalchemys_error_either_way(
    store: SessionStore, db: Database, backend: str
) -> None:
    _, session = await new_session(store)
    row = q.message_row(session.id, 0, assistant_message("once"))
    async with db.write() as conn:
        await q.insert_messages(conn, [row])
    with pytest.raises(DuplicateMessage):
        async with db.write() as conn:
            await q.insert_messages(conn, [{**row, "position": 1}])
    raised: list[BaseException] = []
    with contextlib.suppress(DatabaseError):  # the transaction's own report of the failure
        async with db.write() as conn:
            try:
                await q._INSERT_ONE.run(conn, {**row, "position": 2})
            except BaseException as exc:
                raised.append(exc)
                raise
    assert len(raised) == 1
    assert isinstance(raised[0], IntegrityError)


async def _bookkeeping(db: Database, store: SessionStore) -> dict[str, Any]:
    """A message's bookkeeping through the prepared statements of the delivery records, the
    surface's state and the session store: what each read gave back."""
    user = await store.get_or_create_user("slack:T1:U9", "nine")
    assert await store.get_or_create_user("slack:T1:U9") == user  # known: the read
    session, created = await store.get_or_create_session(
        "slack", "T1/C9/1.0", user_id=user, title="a title", temporary=True
    )
    again, created_again = await store.get_or_create_session("slack", "T1/C9/1.0", user_id=user)
    deliveries = Deliveries(db, "slack")

    async def record(ts: str, text: str, context: dict[str, Any], **kw: Any) -> Any:
        return await deliveries.record(
            event_key=f"T1/C9/{ts}",
            thread_key="T1/C9/1.0",
            author="U9",
            message_id=str(uuid.uuid4()),
            text=text,
            context=context,
            **kw,
        )

    first = await record("1.0", "first", {"files": ["é"], "n": 1})
    second = await record("2.0", "second", {})
    stray = await record("3.0", "ignored", {}, stray=True)
    assert first is not None
    assert second is not None
    assert stray is not None
    blocker = await deliveries.blocker(second)
    waiting = await deliveries.wait(second.id, ("received",), "thread", session_id=session.id)
    started = await deliveries.move(first.id, ("received",), "started", session_id=session.id)
    not_again = await deliveries.move(first.id, ("received",), "started")
    await deliveries.set_reply(first.id, "1.5")
    done = await deliveries.move(first.id, ("started",), "done")
    offered = await deliveries.move(second.id, ("waiting",), "offered")
    claimed = await deliveries.claim(second.id, ("offered",), author="U9")
    surface = SurfaceState(db, "slack")
    bound = await surface.bind_thread("T1/C9/1.0", session.id)
    await surface.set_shown(session.id, "m-1")
    await surface.add_ref("T1/C9/1.5", session.id, "m-1", "answer")
    await surface.add_ref("T1/C9/1.5", session.id, "m-2", "answer")  # kept as it was
    return {
        "session": (session.title, session.expires_at is not None, created, created_again),
        "same_session": again == session,
        "found": await store.find_session("slack", "T1/C9/1.0") == session,
        "missing": await store.find_session("slack", "T1/C9/none"),
        "first": first,
        "blocker": blocker == first,
        "waiting": waiting,
        "started": started,
        "not_again": not_again,
        "done": done,
        "offered": offered,
        "claimed": claimed,
        "strays": [r.event_key for r in await deliveries.strays("T1/C9/1.0")],
        "thread": (bound, await surface.get_thread("T1/C9/1.0")),
        "ref": await surface.find_ref("T1/C9/1.5"),
    }


@pytest.mark.parametrize("watched", [False, True], ids=["unwatched", "watched"])
async def test_prepared__bookkeeping_reads_back_the_same_either_way(
    store: SessionStore, db: Database, backend: str, watched: bool
) -> None:
    seen: list[tuple[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if watched:
            seen = stack.enter_context(statements(db))
        got = await _bookkeeping(db, store)
    assert bool(seen) == watched
    assert got["session"] == ("a title", True, True, False)
    assert got["same_session"]
    assert got["found"]
    assert got["blocker"]
    assert got["missing"] is None
    first, waiting, started = got["first"], got["waiting"], got["started"]
    assert first.context == {"files": ["é"], "n": 1}  # JSON decoded
    assert first.created_at.tzinfo is not None  # a UTC datetime, not SQLite's text
    assert (waiting.state, waiting.wait_reason, waiting.owner) == ("waiting", "thread", first.owner)
    assert started.state == "started"
    assert started.session_id == waiting.session_id
    assert started.created_at == first.created_at
    assert isinstance(started.context, dict)
    assert started.takeovers == 0
    assert got["not_again"] is None  # not in the states asked for: nothing changed
    assert (got["done"].state, got["done"].owner, got["done"].reply_ref) == ("done", None, "1.5")
    assert (got["offered"].state, got["offered"].owner) == ("offered", None)
    assert (got["claimed"].state, got["claimed"].owner) == ("received", first.owner)
    assert got["claimed"].wait_reason == "thread"  # kept
    assert got["strays"] == ["T1/C9/3.0"]
    bound, read = got["thread"]
    assert (bound.thread_key, bound.session_id) == (read.thread_key, read.session_id)
    assert bound.last_shown_message_id is None
    assert read.last_shown_message_id == "m-1"
    assert (got["ref"].message_id, got["ref"].kind) == ("m-1", "answer")


@pytest.mark.parametrize("backend", ["postgresql"])
async def test_prepared__unwatched_postgresql_runs_on_asyncpg_inside_the_transaction(
    store: SessionStore, db: Database, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No SQLAlchemy execution, yet the transaction is SQLAlchemy's: its BEGIN is sent
    before the first statement, a failure rolls the statement back, a commit keeps it."""
    _, session = await new_session(store)

    async def not_this_way(*_args: Any) -> Any:
        raise AssertionError("an unwatched hot-path statement went through SQLAlchemy")

    def claim(token: str) -> dict[str, Any]:
        return {
            "sid": session.id,
            "token": token,
            "takeover_token": "t" + token,
            "staleness": 60.0,
            "title": None,
            "abandoned": None,
            "any_tail": True,  # no stale guard, no user message: the claim alone
            "last": None,
            "new_tail": None,
        }

    with contextlib.suppress(RuntimeError), monkeypatch.context() as patched:
        patched.setattr(AsyncConnection, "execute", not_this_way)
        async with db.write() as conn:
            assert await q.claim(conn, claim("rolled-back"), stamp=False) == "rolled-back"
            raise RuntimeError("the transaction fails after the claim")
    assert not await store.is_turn_active(session.id)  # the claim was rolled back with it
    with monkeypatch.context() as patched:
        patched.setattr(AsyncConnection, "execute", not_this_way)
        async with db.write() as conn:
            assert await q.claim(conn, claim("kept"), stamp=False) == "kept"
        async with db.read() as conn:  # a read outside any transaction
            assert (await q._TOKEN.run(conn, {"sid": session.id})).row == ("kept",)
    assert await store.is_turn_active(session.id)


@pytest.mark.parametrize("watched", [False, True], ids=["unwatched", "watched"])
async def test_prepared__stops_are_read_for_every_running_turn_at_once(
    store: SessionStore, db: Database, backend: str, watched: bool
) -> None:
    """The stop poll's one statement (its sessions one JSON parameter) finds exactly the turns
    asked to stop, however many it asks about, and not a later turn of a stopped session."""
    leases = []
    for _ in range(3):
        _, session = await new_session(store)
        leases.append(
            await store.start_turn(session.id, user_message=None, last_message_id=ANY_TAIL)
        )
    assert await store.request_stop(leases[0].session_id)
    assert await store.request_stop(leases[2].session_id)
    with contextlib.ExitStack() as stack:
        if watched:
            stack.enter_context(statements(db))
        assert await store.stops_requested(leases) == {leases[0].session_id, leases[2].session_id}
        assert await store.stops_requested(leases[1:2]) == set()
        await store.release(leases[0])
        later = await store.start_turn(
            leases[0].session_id, user_message=None, last_message_id=ANY_TAIL
        )
        assert await store.stops_requested([later, *leases[1:]]) == {leases[2].session_id}


async def test_prepared__the_stop_poll_looks_up_its_sessions_by_primary_key(
    store: SessionStore, db: Database, backend: str
) -> None:
    """The stop poll runs every second for all of a process's turns: among thousands of
    sessions, its few must be found by their primary key, never by reading every session. On
    SQLite, SQLAlchemy once compared the ``IN`` with 1 (``id IN (…) = 1``), which no index
    serves (13 ms a poll at 50,000 sessions)."""
    user = await store.get_or_create_user("slack:T1:U1")
    numbers = (
        "generate_series(1, 20000) AS n"
        if backend == "postgresql"
        else "(WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < 20000)"
        " SELECT n FROM s)"
    )
    async with db.write() as conn:  # 20,000 sessions, one in a thousand asked to stop
        await conn.execute(
            text(
                "INSERT INTO agent_sessions (project_name, project_session_id, user_id, stop_token)"
                f" SELECT 'slack', 'T1/C1/' || n, {user},"
                f" CASE WHEN n % 1000 = 0 THEN 'stop' END FROM {numbers}"
            )
        )
        await conn.execute(text("ANALYZE"))
    sql = str(_STOPS.statement.compile(dialect=db.sync_engine.dialect))
    ids = json_ids([1, 2, 3])
    async with db.read() as conn:
        if backend == "sqlite":
            explained = await conn.run_sync(
                lambda sync: sync.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, (ids,)).all()
            )
            plan = " ".join(row[-1] for row in explained)
            assert "SEARCH agent_sessions USING INTEGER PRIMARY KEY" in plan
        else:
            # PostgreSQL's planner chooses by its statistics (at 50,000 sessions, by hand:
            # a lookup by key per id); the predicate must only never hide the key from it.
            plan = sql
            assert "IN (SELECT" in plan
            assert ") = true" not in plan
    assert "SCAN agent_sessions" not in plan
    assert ") = 1" not in plan
