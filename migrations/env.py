"""Alembic environment: async engines, batch mode on SQLite, and one connection handed in.

``core.storage.migrate`` runs migrations on a connection it already holds (under PostgreSQL's
advisory lock, or SQLite's write lock), passed as ``config.attributes["connection"]``. Without one
(the ``alembic`` command during development) an engine is built from ``DATABASE_URL``.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from core.settings import load_settings
from core.storage.engine import create_database
from core.storage.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _run(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_with_engine() -> None:
    url = config.get_main_option("sqlalchemy.url") or load_settings().database_url
    db = create_database(url)
    try:
        async with db.migrating() as conn:
            await conn.run_sync(_run)
    finally:
        await db.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run `slack-agent migrate`")

connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    asyncio.run(_run_with_engine())
