"""Bring a database to the newest schema, safely when several replicas start at once.

PostgreSQL: the upgrade runs under a session-level advisory lock, so replicas migrate one at a
time and the later ones find nothing to do. SQLite: the upgrade runs in a ``BEGIN IMMEDIATE``
transaction, which other processes wait for, with foreign keys off so that a batch migration
may rebuild a table without cascading into its children (``Database.migrating``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from core.storage.engine import Database

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
# An arbitrary, fixed 64-bit key: "slack-agent migrate" for every replica of every version.
_ADVISORY_LOCK_KEY = 0x51AC_A6E7_0001


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@functools.cache
def known_revisions() -> frozenset[str]:
    """Every revision this build's migrations know (read once: readiness asks every few
    seconds, and the scripts do not change under a running process)."""
    return frozenset(
        s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()
    )


@functools.cache
def this_builds_head() -> str | None:
    """``head_revision``, read once for the same reason."""
    return head_revision()


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def current_revision(db: Database) -> str | None:
    async with db.read() as conn:
        return await conn.run_sync(_current)


async def upgrade(db: Database, revision: str = "head") -> tuple[str | None, str | None]:
    """Upgrade to ``revision``; returns (revision before, revision after)."""
    config = alembic_config()

    def _run(connection: Connection) -> tuple[str | None, str | None]:
        before = _current(connection)
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
        return before, _current(connection)

    async with db.advisory_lock(_ADVISORY_LOCK_KEY), db.migrating() as conn:
        return await conn.run_sync(_run)


async def create_library_tables(db: Database, metadata: Sequence[Any]) -> None:
    """Create the tables a library brings (slack_sdk's installation and OAuth state stores: their
    ``MetaData``) inside the migration's lock and transaction, like our own schema. Replicas
    starting together would otherwise race on ``CREATE TABLE`` (the check for the table and its
    creation are two statements) and one would exit. Existing tables are left as they are."""

    def _create(connection: Connection) -> None:
        for each in metadata:
            each.create_all(connection)

    async with db.advisory_lock(_ADVISORY_LOCK_KEY), db.migrating() as conn:
        await conn.run_sync(_create)
