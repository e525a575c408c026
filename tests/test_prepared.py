"""``core.storage.prepared``: a hot-path statement gives the same result whichever way it runs.

On SQLite, with nobody watching the engine, it runs on the driver's cursor; watched (here: a
statement listener), and on PostgreSQL, it goes SQLAlchemy's ordinary way. Both ways must bind
the same values (JSON, literals compiled into the statement, NULLs), read the same row and
report a constraint failure as the same SQLAlchemy error.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from core.errors import DatabaseError, DuplicateMessage
from core.messages import assistant_message, user_message
from core.storage import queries as q
from core.storage.engine import Database, InlineConnection
from core.storage.sessions import SessionStore
from tests.helpers import new_session, statements


async def _turn_by_prepared_statements(
    db: Database, session_id: int, text: str, last: str | None
) -> tuple[str | None, int | None, bool, bool]:
    """A claim, a stale-guarded insert, a fence and a release, through ``core.storage.queries``."""
    token = f"token-{text}"
    async with db.write() as conn:
        params = {"sid": session_id, "token": token, "takeover_token": "t" + token}
        claim = {**params, "staleness": 60.0, "title": text, "abandoned": None}
        claimed = await q.claim(conn, claim, stamp=False)
        message = user_message(f"{text} \x00 é")
        row = q.message_row(session_id, 0, message)
        position = await q.insert_if_tail_is(conn, row, last)
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
    # The stale guard: a tail that is not the one seen inserts nothing.
    async with db.write() as conn:
        row = q.message_row(session.id, 1, user_message("late"))
        assert await q.insert_if_tail_is(conn, row, "not-the-tail") is None


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
