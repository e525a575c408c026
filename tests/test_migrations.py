"""``alembic upgrade head`` builds exactly the ORM's schema, on both databases, in parallel too."""

from __future__ import annotations

import asyncio
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from core.db import create_database
from core.migrate import current_revision, head_revision, upgrade
from core.models import Base
from tests.helpers import read_json_line, start_worker, stop_workers


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
