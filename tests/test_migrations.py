"""``alembic upgrade head`` builds exactly the ORM's schema, on both databases, in parallel too."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select, text
from sqlalchemy.engine import Connection

from core.agent.accounting import Payer
from core.errors import DatabaseError
from core.messages import assistant_message, user_message
from core.records import Actor
from core.storage import migrate as core_migrate
from core.storage import queries as q
from core.storage.approvals import Approvals
from core.storage.engine import create_database
from core.storage.migrate import current_revision, head_revision, upgrade
from core.storage.models import Base
from core.storage.sessions import SessionStore
from core.storage.usage import UsageLedger
from core.usage.budgets import parse_budgets
from tests.helpers import (
    add_exchange,
    as_an_older_replica,
    new_session,
    read_json_line,
    rewind_as_an_older_replica,
    start_worker,
    stop_workers,
    tail_on_row,
)


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


def _tables(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


async def test_upgrade_head__matches_the_models(empty_database_url: str) -> None:
    db = create_database(empty_database_url)
    try:
        assert await upgrade(db) == (None, head_revision())
        async with db.read() as conn:
            assert await conn.run_sync(_diff) == []
            tables = await conn.run_sync(_tables)
        assert tables == set(Base.metadata.tables) | {"alembic_version"}
        assert await current_revision(db) == head_revision()
    finally:
        await db.dispose()


async def test_upgrade__is_idempotent(empty_database_url: str) -> None:
    db = create_database(empty_database_url)
    try:
        await upgrade(db)
        assert await upgrade(db) == (head_revision(), head_revision())
    finally:
        await db.dispose()


@pytest.mark.slow  # real processes
async def test_upgrade__replicas_starting_at_once_migrate_one_at_a_time(
    empty_database_url: str,
) -> None:
    procs = [start_worker("migrate", empty_database_url) for _ in range(3)]
    try:
        for proc in procs:
            assert await asyncio.to_thread(read_json_line, proc) == {"ready": True}
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [await asyncio.to_thread(read_json_line, p) for p in procs]
    finally:
        stop_workers(procs)
    head = head_revision()
    assert all(r["after"] == head for r in results)
    assert sorted(str(r["before"]) for r in results) == sorted(["None", head, head])  # type: ignore[list-item]


_THROWAWAY = '''"""A throwaway migration rebuilding the tables with the most children (batch mode).

Revision ID: 9999
Revises: {head}
"""

import sqlalchemy as sa
from alembic import op

revision = "9999"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Changing a column's type rebuilds the table on SQLite (copy, drop, rename).
    for table, column in (
        ("users", "display_name"),
        ("agent_sessions", "title"),
        ("agent_session_messages", "message_id"),
    ):
        with op.batch_alter_table(table, recreate="auto") as batch_op:
            batch_op.alter_column(column, type_=sa.String(length=300))


def downgrade() -> None:
    pass
'''


async def _row_counts(db: Any, tables: list[str]) -> dict[str, int]:
    async with db.read() as conn:
        return {t: int(await conn.scalar(text(f"SELECT count(*) FROM {t}"))) for t in tables}


async def test_upgrade__a_batch_migration_rebuilding_parent_tables_keeps_their_children(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With foreign keys on inside the migration's transaction, dropping the old copy of a
    # rebuilt parent table would cascade-delete every child row (sessions, messages, snapshots).
    store = SessionStore(create_database(database_url))
    try:
        owner, session = await new_session(store)
        ids = await add_exchange(store, session.id, 2)
        await store.set_title(session.id, "kept", Actor(owner))
        forked = await store.branch(session.id, ids[-1], user_id=owner)
        tables = ["users", "agent_sessions", "agent_session_messages"]
        before = await _row_counts(store.db, tables)
        assert before == {"users": 1, "agent_sessions": 2, "agent_session_messages": 8}
        migrations = tmp_path / "migrations"
        shutil.copytree(core_migrate.MIGRATIONS_DIR, migrations)
        (migrations / "versions" / "9999_throwaway.py").write_text(
            _THROWAWAY.replace("{head}", str(head_revision()))
        )
        monkeypatch.setattr(core_migrate, "MIGRATIONS_DIR", migrations)
        assert (await upgrade(store.db))[1] == "9999"
        assert await _row_counts(store.db, tables) == before
        assert len(await store.messages(forked.session.id)) == 4
        # Foreign keys are enforced again afterwards, on every pooled connection.
        with pytest.raises(DatabaseError):
            async with store.db.write() as conn:
                await conn.execute(
                    text(
                        "INSERT INTO agent_sessions (project_name, project_session_id, user_id)"
                        " VALUES ('x', 'y', 987654)"
                    )
                )
    finally:
        await store.db.dispose()


async def _downgrade(db: Any, revision: str) -> None:
    config = core_migrate.alembic_config()

    def _run(connection: Connection) -> None:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)

    async with db.migrating() as conn:
        await conn.run_sync(_run)


async def _message_column(db: Any) -> str:
    async with db.read() as conn:
        if db.url.startswith("sqlite"):
            return "JSON (SQLite)"
        return str(
            await conn.scalar(
                text(
                    "SELECT data_type FROM information_schema.columns"
                    " WHERE table_name = 'agent_session_messages' AND column_name = 'message'"
                )
            )
        )


async def test_migration_0004__messages_keep_their_documents_up_and_down(
    empty_database_url: str,
) -> None:
    """JSONB to ``json`` for a message's document (PostgreSQL; nothing changes on SQLite), on a
    populated database, and back. Each step is followed by a new engine, as replicas restart
    with a deploy: PostgreSQL refuses a statement cached before a column's type changed once
    per connection (``InvalidCachedStatementError``)."""
    stores = [SessionStore(create_database(empty_database_url))]

    async def restarted() -> SessionStore:
        await stores[-1].db.dispose()
        stores.append(SessionStore(create_database(empty_database_url)))
        return stores[-1]

    async def documents(store: SessionStore, session_id: int) -> list[tuple[str, Any]]:
        return [(m.message_id, m.message) for m in await store.messages(session_id)]

    try:
        store = stores[-1]
        await upgrade(store.db, "0003_approvals")
        _owner, session = await new_session(store)
        odd: dict[str, Any] = {
            "parts": [{"type": "text", "text": 'é \u2028 "q"'}],
            "role": "assistant",
        }
        odd["id"] = "0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b"
        # Written as that revision's code wrote them (a turn's statements name columns later
        # revisions add): two exchanges, then two odd documents.
        async with store.db.write() as conn:
            await q.append_messages(
                conn,
                session.id,
                0,
                [
                    (user_message("q1"), False),
                    (assistant_message("a1"), False),
                    (user_message("q2"), False),
                    (assistant_message("a2"), False),
                    (user_message("x", note={"n": [1, 2.5, None]}), False),
                    (odd, False),
                ],
            )
        before = await documents(store, session.id)
        jsonb = await _message_column(store.db)
        assert jsonb in ("jsonb", "JSON (SQLite)")

        assert (await upgrade(store.db, "0004_message_json"))[1] == "0004_message_json"
        store = await restarted()
        assert await documents(store, session.id) == before
        assert await _message_column(store.db) in ("json", "JSON (SQLite)")
        async with store.db.read() as conn:  # later revisions change other tables
            diff = await conn.run_sync(_diff)
        assert [d for d in diff if "agent_session_messages" in repr(d)] == []

        await _downgrade(store.db, "0003_approvals")
        store = await restarted()
        assert await current_revision(store.db) == "0003_approvals"
        assert await documents(store, session.id) == before
        assert await _message_column(store.db) == jsonb

        await upgrade(store.db)
        store = await restarted()
        async with store.db.read() as conn:  # 0011 filled in the tail the stale guard reads
            assert (
                await conn.scalar(
                    select(q.SESSIONS.c.tail_message_id).where(q.SESSIONS.c.id == session.id)
                )
                == odd["id"]
            )
        await store.start_turn(
            session.id, user_message=user_message("y"), last_message_id=odd["id"]
        )
        forked = await store.branch(session.id, odd["id"], user_id=None)
        copied = await store.messages(forked.session.id)
        assert [m.message for m in copied] == [
            {**message, "id": c.message_id} for (_, message), c in zip(before, copied, strict=True)
        ]
        await add_exchange(store, forked.session.id, 1)
        assert len(await store.history(forked.session.id)) == len(before) + 2
    finally:
        await stores[-1].db.dispose()


async def test_migration_0005__approval_arguments_keep_their_values_up_and_down(
    empty_database_url: str,
) -> None:
    """A request stored as JSONB before 0005 reads back the same as text after it (numbers as
    JSONB had normalised them), and one stored after it (a NUL, an integer past 64 bits) goes
    back to JSONB with its NUL replaced, as the transcript keeps it."""
    db = create_database(empty_database_url)
    try:
        await upgrade(db, "0004_message_json")
        store = SessionStore(db)
        _owner, session = await new_session(store)
        row = {
            "session_id": session.id,
            "message_id": "m" * 36,
            "tool_call_id": "c",
            "tool_name": "mcp__notes__add_note",
            "server": "notes",
            "digest": "0" * 64,
            "approvers": "[]",
            "state": "pending",
        }
        insert = text(
            "INSERT INTO tool_approvals (id, session_id, message_id, tool_call_id, tool_name,"
            " server, arguments, digest, approvers, state) VALUES (:id, :session_id,"
            " :message_id, :tool_call_id, :tool_name, :server, :arguments, :digest, :approvers,"
            " :state)"
        )
        async with db.write() as conn:
            await conn.execute(insert, {**row, "id": "a" * 32, "arguments": '{"t": "x", "n": 2}'})
        assert (await upgrade(db, "0005_approval_ends"))[1] == "0005_approval_ends"
        await upgrade(db)  # the statements below read the columns later revisions add
        await db.dispose()
        db = create_database(empty_database_url)
        approvals = Approvals(db, timeout_seconds=60)
        before = await approvals.get("a" * 32)
        assert before is not None
        assert before.arguments == {"t": "x", "n": 2}
        assert before.reason is None
        exact = {"t": "x\x00y", "n": 2**70}
        second = await approvals.request(
            session_id=session.id,
            message_id="m" * 36,
            tool_call_id="d",
            tool_name="mcp__notes__add_note",
            server="notes",
            arguments=exact,
            digest="0" * 64,
            approvers=(),
        )
        assert (await approvals.get(second)).arguments == exact  # type: ignore[union-attr]
        await _downgrade(db, "0004_message_json")
        await db.dispose()
        db = create_database(empty_database_url)
        async with db.read() as conn:
            rows = (
                await conn.execute(text("SELECT id, arguments FROM tool_approvals ORDER BY id"))
            ).all()
        documents = [json.loads(a) if isinstance(a, str) else a for _, a in rows]
        assert {"t": "x", "n": 2} in documents
        assert any(d.get("n") == 2**70 and d.get("t") in ("x\ufffdy", "x\x00y") for d in documents)
    finally:
        await db.dispose()


async def test_migration_0008__old_requests_have_no_requester_and_new_ones_keep_theirs(
    empty_database_url: str,
) -> None:
    """A request written before 0008 reads back with ``requested_by`` None (the API then shows
    the owner, as before); one written after keeps who asked; down and up again keeps both
    rows."""
    db = create_database(empty_database_url)
    try:
        await upgrade(db, "0007_budget_totals")
        store = SessionStore(db)
        _owner, session = await new_session(store)
        async with db.write() as conn:
            await conn.execute(
                text(
                    "INSERT INTO tool_approvals (id, session_id, message_id, tool_call_id,"
                    " tool_name, server, arguments, digest, approvers, state) VALUES (:id,"
                    " :session_id, :message_id, 'c', 'mcp__notes__add_note', 'notes', '{}',"
                    " :digest, '[]', 'pending')"
                ),
                {
                    "id": "a" * 32,
                    "session_id": session.id,
                    "message_id": "m" * 36,
                    "digest": "0" * 64,
                },
            )
        await upgrade(db)
        await db.dispose()
        db = create_database(empty_database_url)
        approvals = Approvals(db, timeout_seconds=60)
        old = await approvals.get("a" * 32)
        assert old is not None
        assert old.requested_by is None
        new = await approvals.request(
            session_id=session.id,
            message_id="m" * 36,
            tool_call_id="d",
            tool_name="mcp__notes__add_note",
            server="notes",
            arguments={},
            digest="0" * 64,
            approvers=(),
            requested_by="slack:T1:U2",
        )
        assert (await approvals.get(new)).requested_by == "slack:T1:U2"  # type: ignore[union-attr]
        await _downgrade(db, "0007_budget_totals")
        async with db.read() as conn:
            count = await conn.scalar(text("SELECT count(*) FROM tool_approvals"))
        assert count == 2
        await upgrade(db)
        assert (await approvals.get(new)).requested_by is None  # type: ignore[union-attr]
    finally:
        await db.dispose()


async def _tail_function(db: Any) -> str | None:
    """The body of the tail triggers' function (PostgreSQL; None on SQLite, which has none)."""
    if db.url.startswith("sqlite"):
        return None
    async with db.read() as conn:
        return str(
            await conn.scalar(
                text("SELECT prosrc FROM pg_proc WHERE proname = 'agent_session_tail_follows'")
            )
        )


async def test_migration_0012__the_tail_follows_an_old_replica_up_and_down(
    database_url: str,
) -> None:
    """0012 replaces the tail triggers' function by one that looks up each touched session's
    newest message once (0011's did it once a row): at either revision an older replica's
    writes, on a connection that does not say it keeps the tail, move the session's tail;
    down to 0011 puts its body back, and up again the new one. SQLite: both steps run and
    change nothing."""
    db = create_database(database_url)
    store = SessionStore(db)

    async def older_exchange(at: int) -> str:
        """A question and answer as an older replica writes them; its answer's id."""
        if db.url.startswith("sqlite"):  # one replica: nothing older beside this code's writes
            return (await add_exchange(store, session.id, 1))[-1]
        async with as_an_older_replica(db) as conn:
            added = await q.append_messages(
                conn, session.id, at, [(user_message("q"), False), (assistant_message("a"), False)]
            )
        return added[-1].message_id

    try:
        _owner, session = await new_session(store)
        first = await add_exchange(store, session.id, 1)
        per_session = await _tail_function(db)
        assert per_session is None or "FROM (SELECT DISTINCT touched.session_id" in per_session
        answer = await older_exchange(2)
        assert await tail_on_row(db, session.id) == answer

        await _downgrade(db, "0011_session_tail")
        assert await current_revision(db) == "0011_session_tail"
        per_row = await _tail_function(db)
        assert per_row is None or "SELECT DISTINCT touched.session_id AS session_id, (" in per_row
        answer = await older_exchange(4)
        assert await tail_on_row(db, session.id) == answer

        await upgrade(db)
        assert await current_revision(db) == head_revision()
        assert await _tail_function(db) == per_session
        answer = await older_exchange(6)
        assert await tail_on_row(db, session.id) == answer
        if not db.url.startswith("sqlite"):  # an older replica's rewind moves it back
            await rewind_as_an_older_replica(db, session.id, 2)
            assert await tail_on_row(db, session.id) == first[-1]
    finally:
        await db.dispose()


async def test_migration_0013__the_locked_snapshot_function_up_and_down(
    database_url: str,
) -> None:
    """0013 adds ``usage_locked_snapshot`` (PostgreSQL), which a budgeted claim's one
    statement calls: down to 0012 drops it, up again makes it, and a budgeted claim is then
    admitted. SQLite: both steps run and change nothing."""
    db = create_database(database_url)
    store = SessionStore(db)

    async def functions() -> int:
        if db.url.startswith("sqlite"):
            return 0
        async with db.read() as conn:
            found = await conn.scalar(
                text("SELECT count(*) FROM pg_proc WHERE proname = 'usage_locked_snapshot'")
            )
        return int(found)

    try:
        expected = 0 if db.url.startswith("sqlite") else 1
        assert await functions() == expected
        await _downgrade(db, "0012_tail_per_session")
        assert await current_revision(db) == "0012_tail_per_session"
        assert await functions() == 0
        await upgrade(db)
        assert await current_revision(db) == head_revision()
        assert await functions() == expected
        ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
        _, session = await new_session(store)
        lease = await store.start_turn(
            session.id,
            user_message=user_message("hi"),
            last_message_id=None,
            reservation=ledger.reservation(
                parse_budgets("user:day:100000tokens,all:day:100000tokens"),
                Payer("slack:T1:U1", "T1"),
            ),
        )
        await store.release(lease)
        assert len(await store.messages(session.id)) == 1
    finally:
        await db.dispose()
