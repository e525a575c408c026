"""The only module that creates engines, and the SQL pieces that differ per database.

SQLite is tuned for an agent's write pattern: WAL (readers never block the writer), foreign keys
on, a busy timeout for other processes, and every write transaction opened with
``BEGIN IMMEDIATE`` so a transaction never has to upgrade a read lock to a write lock (that
upgrade fails at once with ``database is locked`` instead of waiting). Inside one process the
writers are also queued on an ``asyncio.Lock`` (``Database.write``): SQLite admits one writer at a
time anyway, and waiting on a lock in the event loop costs microseconds where SQLite's busy handler
sleeps in steps of up to 100 ms.

All time that decides anything (lock staleness, expiry, idleness) is the database's clock
(``db_now``), so replicas with skewed clocks agree.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Table, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import TypeDecorator

from core.errors import DatabaseError
from core.settings import normalize_database_url

SQLITE_BUSY_TIMEOUT_MS = 30_000
# SQLite's strftime has millisecond precision; the trailing zeros give SQLAlchemy's own
# six-digit storage format, so values written by SQL and by Python compare as strings.
_SQLITE_NOW = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both databases (SQLite stores naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class db_now(FunctionElement[datetime]):
    """The database's current time, optionally plus a (signed) number of seconds."""

    type = UtcDateTime()
    inherit_cache = True
    name = "db_now"


@compiles(db_now, "sqlite")
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    args = list(element.clauses)
    if not args:
        return _SQLITE_NOW
    seconds = compiler.process(args[0], **kw)
    return f"strftime('%Y-%m-%d %H:%M:%f000', 'now', ({seconds}) || ' seconds')"


@compiles(db_now, "postgresql")
def _pg_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    args = list(element.clauses)
    if not args:
        return "statement_timestamp()"
    seconds = compiler.process(args[0], **kw)
    return f"(statement_timestamp() + make_interval(secs => CAST({seconds} AS double precision)))"


def ago(seconds: float) -> db_now:
    """``db_now() - seconds``: the boundary for staleness and retention checks."""
    return db_now(-float(seconds))


def hence(seconds: float) -> db_now:
    """``db_now() + seconds``: expiry times of temporary sessions."""
    return db_now(float(seconds))


@dataclass
class Database:
    """An engine plus the in-process writer queue SQLite needs (see the module docstring)."""

    engine: AsyncEngine
    _write_lock: asyncio.Lock | None = field(default=None, repr=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A short read transaction (deferred on SQLite: never blocks or is blocked by writers)."""
        try:
            async with self.engine.connect() as conn:
                yield conn
        except (SQLAlchemyError, OSError) as exc:
            raise database_error(exc) from exc

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction, committed on success and rolled back on any error."""
        lock = self._write_lock
        try:
            if lock is None:
                async with self.engine.begin() as conn:
                    yield conn
            else:
                async with lock, self.engine.connect() as conn:
                    conn = await conn.execution_options(sqlite_write=True)
                    async with conn.begin():
                        yield conn
        except (SQLAlchemyError, OSError) as exc:
            raise database_error(exc) from exc

    def upsert(self, table: Table) -> postgresql.Insert | sqlite.Insert:
        """INSERT with ``on_conflict_do_*`` (both dialects spell it the same, from their module)."""
        if self.dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    async def dispose(self) -> None:
        await self.engine.dispose()


def database_error(exc: BaseException) -> DatabaseError:
    """One line naming the driver's complaint, without SQLAlchemy's SQL echo and links."""
    cause = getattr(exc, "orig", None) or exc
    detail = (str(cause).strip().splitlines() or [""])[0]
    return DatabaseError(f"{cause.__class__.__name__}: {detail}")


def create_database(url: str, *, echo: bool = False, pool_size: int = 10) -> Database:
    """Create the engine for ``url`` (normalised and checked, see ``normalize_database_url``)."""
    url = normalize_database_url(url)
    if url.startswith("sqlite"):
        engine = create_async_engine(
            url,
            echo=echo,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            pool_size=pool_size,
            max_overflow=pool_size,
        )
        _configure_sqlite(engine)
        return Database(engine, asyncio.Lock())
    engine = create_async_engine(
        url, echo=echo, pool_size=pool_size, max_overflow=pool_size * 4, pool_pre_ping=False
    )
    return Database(engine)


def _configure_sqlite(engine: AsyncEngine) -> None:
    sync_engine = engine.sync_engine

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite's own is always deferred).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("sqlite_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
