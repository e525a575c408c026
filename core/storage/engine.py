"""The only module that creates engines, and how transactions are opened on them.

SQLite is tuned for an agent's write pattern: WAL (readers never block the writer), foreign keys
on, and every write transaction opened with ``BEGIN IMMEDIATE`` so a transaction never has to
upgrade a read lock to a write lock (that upgrade fails at once with ``database is locked``
instead of waiting). Inside one process the writers queue on an ``asyncio.Lock``: SQLite admits
one writer at a time anyway, and waiting on a lock in the event loop costs microseconds where
SQLite's busy handler sleeps in steps of up to 100 ms. Another process's write lock is waited
for with ``asyncio.sleep`` (``Database.write``), so the event loop never sleeps inside SQLite.

The SQL pieces that differ per database (the clock, a fork's ids) are ``core.storage.dialect``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import socket
import sqlite3
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, TypeVar, cast

import orjson
from sqlalchemy import (
    Engine,
    Table,
    create_engine,
    event,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import (
    Connection,
    CursorResult,
    Dialect,
    ExceptionContext,
    ScalarResult,
    make_url,
)
from sqlalchemy.exc import DisconnectionError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.base import Executable

from core.errors import ConfigError, DatabaseError, DatabaseValueRefused
from core.settings import normalize_database_url

T = TypeVar("T")
log = logging.getLogger(__name__)
# The oldest SQLite the SQL here is written for: what RHEL 9's Python 3.11 links (3.34.1),
# below Ubuntu 22.04 (3.37.2) and Debian 12 (3.40.1). So no RETURNING or MATERIALIZED
# (3.35), no HAVING without GROUP BY (3.39), no UPDATE … FROM on SQLite.
MIN_SQLITE: tuple[int, int, int] = (3, 31, 0)
# How long a migration waits for another process's write lock before giving up (replicas
# starting together on a new file); other writers wait ``DatabaseTimeouts.statement``.
SQLITE_WRITE_WAIT_SECONDS = 30.0
# Readers in WAL mode wait only in rare cases (another connection recovering the WAL).
SQLITE_READ_BUSY_MS = 1_000
HEALTH_TIMEOUT_SECONDS = 5.0
# A PostgreSQL setting each of this process's connections carries: it moves the session's
# tail itself (migration 0011's triggers read it).
KEEPS_TAIL = "slack_agent.keeps_tail"


class Probe(NamedTuple):
    """What a health read found: the database answered, and the schema revision it holds."""

    answered: bool
    revision: str | None


def json_loads(text: str | bytes) -> Any:
    """Decode a stored JSON document: orjson, about three times the standard library's speed
    (a transcript's messages are most of what a history load costs: docs/benchmarks.md,
    *History load of 10,000 messages*). What orjson refuses and the standard library wrote
    (NaN, Infinity, a lone surrogate) goes to the standard library, so every stored document
    still reads back. One difference stays: an integer beyond 64 bits reads back as a float."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


@dataclass(frozen=True)
class DatabaseTimeouts:
    """How long a database call may take (§6.12): a half-open connection (a network partition,
    a failover, a peer that stopped answering without closing) must not hold a turn, a lease
    loop or the stop-button poll. Chosen from the staleness window by the settings
    (``Settings.database_timeouts``); the defaults are those of the default window.

    PostgreSQL: ``connect`` bounds a new connection (asyncpg's ``timeout``); ``statement`` every
    statement on the client (asyncpg's ``command_timeout``: the only bound that notices a
    server gone silent) and on the server (``statement_timeout``, so the server stops work its
    client gave up on), and how long the server lets a session sit idle inside a transaction
    (``idle_in_transaction_session_timeout``: the row locks of a partitioned replica's open
    transaction are let go before another replica needs those rows). TCP keepalive on both
    ends notices a peer that vanished while a connection idles. A statement that timed out
    takes its connection with it (never back to the pool half-used).

    SQLite: ``statement`` bounds a writer's wait for another process's write lock.
    """

    connect: float = 8.25
    statement: float = 16.5

    @property
    def keepalive(self) -> tuple[int, int, int]:
        """(idle, interval, probes) seconds: a silent peer is noticed within ``statement``."""
        idle = max(1, int(self.statement / 2))
        interval = max(1, int(self.statement / 6))
        return idle, interval, 3

    def server_settings(self) -> dict[str, str]:
        idle, interval, probes = self.keepalive
        return {
            "statement_timeout": str(int(self.statement * 1000)),
            "idle_in_transaction_session_timeout": str(int(self.statement * 1000)),
            "tcp_keepalives_idle": str(idle),
            "tcp_keepalives_interval": str(interval),
            "tcp_keepalives_count": str(probes),
        }


class Conn(Protocol):
    """What a transaction body sees: ``AsyncConnection`` on PostgreSQL, ``InlineConnection`` on
    SQLite. Only these methods are used, so the two are interchangeable."""

    @property
    def dialect(self) -> Dialect: ...

    async def execute(self, statement: Executable, parameters: Any = None) -> CursorResult[Any]: ...

    async def scalar(self, statement: Executable, parameters: Any = None) -> Any: ...

    async def scalars(self, statement: Executable, parameters: Any = None) -> ScalarResult[Any]: ...

    async def run_sync(self, fn: Callable[[Connection], T]) -> T: ...


class InlineConnection:
    """An async face on a sync SQLite connection: each statement runs in place.

    A SQLite statement of the turn protocol takes tens of microseconds; handing it to a worker
    thread and back (what aiosqlite does, three or four times per statement) costs several times
    that, and was most of a turn's time. Running in place blocks the event loop only for the
    statement itself: waiting for another process's write lock happens in ``Database.write``
    with ``asyncio.sleep``, never in SQLite's busy handler.
    """

    def __init__(self, connection: Connection) -> None:
        self.sync_connection = connection

    @property
    def dialect(self) -> Dialect:
        return self.sync_connection.dialect

    async def execute(self, statement: Executable, parameters: Any = None) -> CursorResult[Any]:
        return self.sync_connection.execute(statement, parameters)

    async def scalar(self, statement: Executable, parameters: Any = None) -> Any:
        return self.sync_connection.scalar(statement, parameters)

    async def scalars(self, statement: Executable, parameters: Any = None) -> ScalarResult[Any]:
        return self.sync_connection.scalars(statement, parameters)

    async def run_sync(self, fn: Callable[[Connection], T]) -> T:
        """``fn`` with the connection, SQLAlchemy told of the transaction it is in first: a
        write of prepared statements leaves SQLAlchemy's view unbegun (``Database.write``), and
        code given the connection (an ORM session, Alembic) must join the write's transaction,
        not begin and end one of its own (an ORM session closed without committing rolls back
        a transaction it began, and so the write's)."""
        if not self.sync_connection.in_transaction():
            self.sync_connection.begin()
        return fn(self.sync_connection)


class ThreadedConnection(InlineConnection):
    """``InlineConnection`` whose statements run in a worker thread, one at a time.

    For the few operations whose statements grow with the data (a fork copying a whole
    transcript, an import, a sweep's batches): the event loop keeps answering (acknowledging
    Slack, heartbeating other turns) while SQLite works. Rows are fetched in the thread too.
    The hot path (a turn's small statements) stays inline, where a thread hop would cost more
    than the statement.
    """

    async def execute(self, statement: Executable, parameters: Any = None) -> CursorResult[Any]:
        return await asyncio.to_thread(self._execute, statement, parameters)

    def _execute(self, statement: Executable, parameters: Any) -> CursorResult[Any]:
        result = self.sync_connection.execute(statement, parameters)
        if not result.returns_rows:
            return result
        # Fetched here, not on the loop; the caller iterates a buffered copy.
        return cast(CursorResult[Any], result.freeze()())

    async def scalar(self, statement: Executable, parameters: Any = None) -> Any:
        return await asyncio.to_thread(self.sync_connection.scalar, statement, parameters)

    async def scalars(self, statement: Executable, parameters: Any = None) -> ScalarResult[Any]:
        result = await self.execute(statement, parameters)
        return result.scalars()

    async def run_sync(self, fn: Callable[[Connection], T]) -> T:
        return await asyncio.to_thread(fn, self.sync_connection)


# Connections of a PostgreSQL ``Database`` kept for urgent writes (``Database.write``).
URGENT_POOL_SIZE = 2


class _WriteLock:
    """SQLite's writers in this process, one at a time, in arrival order, except that an urgent
    writer goes before every waiting ordinary one: a message's delivery record, which Slack's
    acknowledgement waits for, must not queue behind the writes of a hundred running turns.
    The lock passes directly from holder to next waiter, so no one overtakes in between."""

    def __init__(self) -> None:
        self._held = False
        self._urgent: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ordinary: collections.deque[asyncio.Future[None]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, *, urgent: bool = False) -> AsyncIterator[None]:
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    def _take_free(self) -> bool:
        """Take the lock if it is free and nobody waits (no await: most writes find it so)."""
        if self._held or self._urgent or self._ordinary:
            return False
        self._held = True
        return True

    async def _acquire(self, urgent: bool) -> None:
        if self._take_free():
            return
        queue = self._urgent if urgent else self._ordinary
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # handed the lock as the wait was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it already
                    queue.remove(turn)
            raise

    def _release(self) -> None:
        for queue in (self._urgent, self._ordinary):
            while queue:
                turn = queue.popleft()
                if not turn.done():
                    turn.set_result(None)  # still held: it is theirs now
                    return
        self._held = False


# What an inline SQLite write may raise that ``database_error`` makes ours: SQLAlchemy's, the
# file's, and ``sqlite3``'s own from the writer's bare commit.
_SQLITE_DRIVER_ERRORS: Final = (SQLAlchemyError, OSError, sqlite3.Error)


class _InlineWrite:
    """One of SQLite's inline write transactions (``Database.write``): this process's write
    lock (``_WriteLock``), ``BEGIN IMMEDIATE`` on the writer connection, the body's statements
    in place, then the commit, or the rollback on any error or cancellation; the lock is let
    go last. Driver errors reach the caller as ``database_error`` makes them, as from every
    transaction.

    A class, not generator-based context managers: ``write`` in ``hold`` (and ``autocommit``
    around ``write``) were three async generators a transaction, each made, registered with
    the event loop and finalised, about 7 µs of a write's CPU where SQLite's ``BEGIN
    IMMEDIATE`` and an empty commit are about 5 (docs/benchmarks.md, thirteenth pass)."""

    __slots__ = ("_conn", "_db", "_urgent")

    def __init__(self, db: Database, urgent: bool) -> None:
        self._db = db
        self._urgent = urgent
        self._conn: Connection | None = None

    async def __aenter__(self) -> Conn:
        lock = self._db._write_lock
        if not lock._take_free():
            await lock._acquire(self._urgent)
        try:
            self._conn = await self._db._sqlite_writer_begin()
        except BaseException as exc:
            lock._release()
            if isinstance(exc, _SQLITE_DRIVER_ERRORS):
                raise database_error(exc) from exc
            raise
        return InlineConnection(self._conn)

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        conn = self._conn
        assert conn is not None
        self._conn = None
        try:
            if exc is None:
                try:
                    if conn.in_transaction():  # an ordinary statement began SQLAlchemy's
                        conn.commit()
                    else:
                        _raw(conn).commit()
                except BaseException as failed:
                    self._db._roll_back_writer(conn)
                    if isinstance(failed, _SQLITE_DRIVER_ERRORS):
                        raise database_error(failed) from failed
                    raise
                return
            self._db._roll_back_writer(conn)
            if isinstance(exc, _SQLITE_DRIVER_ERRORS):
                raise database_error(exc) from exc
        finally:
            self._db._write_lock._release()


class Database:
    """The engine of one database, and how transactions are opened on it.

    PostgreSQL: an async engine (asyncpg). SQLite: a sync engine (pysqlite) whose statements run
    in place (``InlineConnection``); writers queue on an ``asyncio.Lock`` and open with
    ``BEGIN IMMEDIATE``, retried with ``asyncio.sleep`` while another process writes.
    """

    def __init__(
        self,
        url: str,
        *,
        echo: bool = False,
        pool_size: int = 10,
        synchronous_commit: bool = True,
        timeouts: DatabaseTimeouts | None = None,
    ) -> None:
        self.url = normalize_database_url(url)
        self.timeouts = timeouts or DatabaseTimeouts()
        self._async: AsyncEngine | None = None
        self._urgent: AsyncEngine | None = None
        self._schema: AsyncEngine | None = None  # PostgreSQL migrations: _schema_engine
        self._sqlite: Engine | None = None
        self._sqlite_uri = ""  # SQLite: see _sqlite_file
        self._writer: Connection | None = None  # SQLite's inline writes: _sqlite_writer_begin
        self._reader: PoolProxiedConnection | None = None  # SQLite's one-statement reads
        # PostgreSQL's statements of their own: connections held idle (``autocommit``), how
        # many are held (idle or in use), and the event loop they belong to. They are taken
        # from the pool: at most its kept connections (``pool_size``), so its overflow, as
        # many again, is left for transactions. Two were held until 2026-12-05: at 500 turns
        # at once 28 % of these statements found both busy and paid for a pooled connection
        # (docs/benchmarks.md, eighth pass).
        self._held: list[AsyncConnection] = []
        self._holding = 0
        self.held_at_most = pool_size
        self._held_loop: asyncio.AbstractEventLoop | None = None
        self._write_lock = _WriteLock()
        if self.url.startswith("sqlite"):
            check_sqlite_version()
            sync_url = make_url(self.url.replace("sqlite+aiosqlite", "sqlite+pysqlite", 1))
            self._sqlite_uri = _sqlite_file(sync_url.database or "")
            self._sqlite = create_engine(
                sync_url,
                echo=echo,
                pool_size=pool_size,
                max_overflow=pool_size,
                creator=functools.partial(
                    sqlite3.connect, self._sqlite_uri, uri=True, check_same_thread=False
                ),
                json_deserializer=json_loads,
            )
            _configure_sqlite(self._sqlite)
        else:
            # synchronous_commit=off: a commit returns before its WAL record is flushed. A
            # PostgreSQL crash may then lose the last fraction of a second of commits (never
            # consistency); a crash of this process loses nothing. Off only when asked for.
            server_settings = self.timeouts.server_settings()
            if not synchronous_commit:
                server_settings["synchronous_commit"] = "off"
            # This code moves ``agent_sessions.tail_message_id`` with every write of messages:
            # the triggers that keep it for writers that do not (migration 0011) stay idle.
            server_settings[KEEPS_TAIL] = "on"

            def engine(size: int) -> AsyncEngine:
                return bounded_engine(
                    self.url,
                    self.timeouts,
                    echo=echo,
                    pool_size=size,
                    max_overflow=size,
                    server_settings=server_settings,
                )

            self._async = engine(pool_size)
            # Urgent writes (``write(urgent=True)``) have connections of their own, so they
            # never queue behind the turns holding the main pool's.
            self._urgent = engine(URGENT_POOL_SIZE)

    @property
    def dialect(self) -> str:
        return self.sync_engine.dialect.name

    @property
    def sync_engine(self) -> Engine:
        """The engine events listen on (statement counting, plans), on either database.
        PostgreSQL's urgent writes run on an engine of their own, which it does not see."""
        if self._sqlite is not None:
            return self._sqlite
        assert self._async is not None
        return self._async.sync_engine

    @contextlib.asynccontextmanager
    async def read(self, *, large: bool = False) -> AsyncIterator[Conn]:
        """A short read transaction (deferred on SQLite: never blocks or is blocked by writers).

        ``large``: SQLite runs the statements in a worker thread (``ThreadedConnection``), for
        reads that grow with the data; no effect on PostgreSQL, whose driver never blocks.
        """
        try:
            if self._sqlite is not None:
                with self._sqlite.connect() as conn:
                    yield ThreadedConnection(conn) if large else InlineConnection(conn)
            else:
                assert self._async is not None
                async with self._async.connect() as aconn:
                    yield aconn
        except (SQLAlchemyError, OSError, sqlite3.Error) as exc:
            raise database_error(exc) from exc

    @contextlib.contextmanager
    def sqlite_reader(self) -> Iterator[sqlite3.Connection]:
        """SQLite: the process's connection for reads of one statement, run in place outside
        any transaction (``Prepared.fetch``).

        One statement in autocommit mode is a read transaction of its own, as consistent as
        one inside BEGIN … ROLLBACK; skipping those two statements and the pool's checkout,
        checkin and reset of a connection was about half of such a read's CPU (SQLite's own
        work is tens of microseconds). The statement runs without awaiting, so one connection
        serves every such read of the process. A connection that failed is closed (SQLite rolls
        back as it closes) and the next read opens another; the error reaches the caller as
        ``read``'s do."""
        assert self._sqlite is not None
        try:
            if self._reader is None:
                self._reader = self._sqlite.raw_connection()
            yield cast(sqlite3.Connection, self._reader.dbapi_connection)
        except (SQLAlchemyError, OSError, sqlite3.Error) as exc:
            reader, self._reader = self._reader, None
            if reader is not None:
                reader.invalidate()
            raise database_error(exc) from exc

    def write(
        self, *, consistent: bool = False, large: bool = False, urgent: bool = False
    ) -> contextlib.AbstractAsyncContextManager[Conn]:
        """One write transaction, committed on success and rolled back on any error.

        ``urgent``: ahead of this process's other writers: on SQLite before the waiting ones
        (``_WriteLock``), on PostgreSQL on connections of its own.

        ``large``: as for ``read``, SQLite runs the statements (and the commit) in a worker
        thread, so an operation whose statements grow with the data never holds the loop.

        ``consistent``: every statement reads the same snapshot of the database (PostgreSQL
        REPEATABLE READ, for a transaction that reads in several statements what others may
        change meanwhile, such as a fork reading its source). SQLite's write transaction is
        already that: no other writer commits while it runs.

        SQLite's inline writes (most of a turn's) are ``_InlineWrite``, a context manager
        of its own rather than nested generators: see there.
        """
        if self._sqlite is not None and not large:
            return _InlineWrite(self, urgent)
        return self._write(consistent=consistent, large=large, urgent=urgent)

    @contextlib.asynccontextmanager
    async def _write(self, *, consistent: bool, large: bool, urgent: bool) -> AsyncIterator[Conn]:
        """``write``'s transactions other than SQLite's inline ones."""
        try:
            if self._async is not None and consistent:
                async with self._async.connect() as aconn:
                    aconn = await aconn.execution_options(isolation_level="REPEATABLE READ")
                    async with aconn.begin():
                        yield aconn
            elif self._sqlite is not None and large:
                async with self._write_lock.hold(urgent=urgent):
                    conn = await self._sqlite_begin_immediate(
                        self._sqlite, wait=self.timeouts.statement
                    )
                    try:
                        yield ThreadedConnection(conn)
                        await asyncio.to_thread(conn.commit)
                    finally:
                        conn.close()  # rolls back whatever was not committed
            else:
                engine = self._urgent if urgent else self._async
                assert engine is not None
                async with engine.begin() as aconn:
                    yield aconn
        except (SQLAlchemyError, OSError, sqlite3.Error) as exc:
            raise database_error(exc) from exc

    @contextlib.asynccontextmanager
    async def migrating(self) -> AsyncIterator[Conn]:
        """The write transaction migrations run in.

        SQLite, the recipe Alembic documents for batch mode: foreign keys are turned off on
        the connection *before* the transaction (``PRAGMA foreign_keys`` does nothing inside
        one), so a migration that rebuilds a table (copy, drop the old one, rename) does not
        cascade the drop into its children; before the commit ``PRAGMA foreign_key_check``
        must find no row pointing nowhere, and the connection gets foreign keys back before it
        returns to the pool. PostgreSQL: an ordinary transaction (its DDL alters in place).
        """
        if self._sqlite is None:
            try:
                async with self._schema_engine().begin() as aconn:
                    yield aconn
            except (SQLAlchemyError, OSError) as exc:
                raise database_error(exc) from exc
            return
        try:
            async with self._write_lock.hold():
                locked = await self._sqlite_begin_immediate(
                    self._sqlite, wait=SQLITE_WRITE_WAIT_SECONDS, foreign_keys=False
                )
                raw = _raw(locked)
                # A statement that reads the file, so the schema another replica's migration
                # just committed is loaded: Alembic asks with PRAGMA table_info, which answers
                # from the connection's cached schema (on older SQLite it is then stale).
                raw.execute("SELECT count(*) FROM sqlite_master").fetchone()
                try:
                    yield InlineConnection(locked)
                    broken = raw.execute("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise DatabaseError(
                            f"the migration left {len(broken)} row(s) whose foreign key points "
                            f"nowhere (first: table {broken[0][0]}, row {broken[0][1]}); "
                            "nothing was changed"
                        )
                    locked.commit()
                finally:
                    locked.rollback()  # whatever was not committed; then outside any transaction
                    raw.execute("PRAGMA foreign_keys=ON")
                    locked.close()
        except (SQLAlchemyError, OSError, sqlite3.Error) as exc:
            raise database_error(exc) from exc

    def _schema_engine(self) -> AsyncEngine:
        """PostgreSQL: connections for migrations and their lock, without a statement timeout
        (a migration may rewrite a large table; a replica waits for another's migration as
        long as it takes), made when first needed."""
        if self._schema is None:
            connect = self.timeouts.connect
            self._schema = create_async_engine(
                self.url, pool_size=2, max_overflow=0, connect_args={"timeout": connect}
            )
        return self._schema

    def autocommit(self, *, urgent: bool = False) -> contextlib.AbstractAsyncContextManager[Conn]:
        """PostgreSQL: a connection outside any transaction, for statements of their own (no
        BEGIN or COMMIT round trips: most of a turn's bookkeeping, a record's moves, a
        message's reference, the thread's mark, the usage row, and its reads of one statement,
        are one statement each). SQLite: an ordinary write transaction.

        The connection is one of those the process holds open for this (``held_at_most``):
        opening an ``AsyncConnection`` per statement (the pool's checkout and checkin, a
        greenlet each way, a task to close it, the isolation level set and reset) cost about
        125 µs of CPU a statement, about what the rest of a statement costs now
        (``bench.bookkeeping``'s round, 15 such statements among about 23: 4.85 ms unheld,
        2.96 ms held). When all are busy, or for ``urgent`` statements (their own pool,
        ``write``), a pooled connection is opened as before. A connection whose statement
        failed, or was cancelled mid-way, goes back to the pool (which resets it, or drops it
        if it broke) instead of being held again."""
        if self._async is None:
            return self.write(urgent=urgent)
        return self._autocommit(urgent)

    @contextlib.asynccontextmanager
    async def _autocommit(self, urgent: bool) -> AsyncIterator[Conn]:
        """``autocommit`` on PostgreSQL."""
        try:
            held = None if urgent else await self._take_held()
            if held is None:
                engine = self._urgent if urgent else self._async
                assert engine is not None
                async with engine.connect() as aconn:
                    yield await aconn.execution_options(isolation_level="AUTOCOMMIT")
                return
            try:
                yield held
            except BaseException:
                await self._drop_held(held)
                raise
            await self._give_back(held)
        except (SQLAlchemyError, OSError) as exc:
            raise database_error(exc) from exc

    async def _take_held(self) -> AsyncConnection | None:
        """An idle held connection, or a new one while fewer than ``held_at_most`` are held;
        None when all are busy, or on an event loop other than theirs (asyncpg's connections
        belong to the loop that opened them)."""
        loop = asyncio.get_running_loop()
        if self._held_loop is None:
            self._held_loop = loop
        elif self._held_loop is not loop:
            return None
        while self._held:
            held = self._held.pop()
            if not _ended_by_server(held):
                return held
            await self._drop_held(held, invalidate=True)
        if self._holding >= self.held_at_most:
            return None
        assert self._async is not None
        self._holding += 1
        try:
            aconn = self._async.connect()  # the pool lends no connection the server ended
            await aconn.start()
            return await aconn.execution_options(isolation_level="AUTOCOMMIT")
        except BaseException:
            self._holding -= 1
            raise

    async def _give_back(self, held: AsyncConnection) -> None:
        """A held connection whose use ended without an error: idle again, unless a failed
        statement invalidated it. A statement sent SQLAlchemy's ordinary way began its view of
        a transaction (autobegin; nothing is sent in autocommit mode): ended here, so the next
        use starts from none."""
        sync = held.sync_connection
        if sync is None or sync.invalidated or sync.closed:
            await self._drop_held(held)
            return
        if held.in_transaction():
            await held.rollback()
        self._held.append(held)

    async def _drop_held(self, held: AsyncConnection, *, invalidate: bool = False) -> None:
        """A held connection no longer held: back to the pool, which resets it (or drops it if
        it broke), or discarded (``invalidate``); shielded, so a cancellation cannot leave it
        half-closed."""
        self._holding -= 1
        sync = held.sync_connection
        if invalidate and sync is not None and not (sync.closed or sync.invalidated):
            await asyncio.shield(held.invalidate())
        await asyncio.shield(held.close())

    @staticmethod
    async def _sqlite_begin_immediate(
        engine: Engine, *, wait: float, foreign_keys: bool = True
    ) -> Connection:
        """A pooled connection in a new ``BEGIN IMMEDIATE`` transaction (large writes, which
        run in a worker thread, and migrations)."""
        conn = engine.connect()
        raw = _raw(conn)
        try:
            if not foreign_keys:  # only outside a transaction does this take effect
                raw.execute("PRAGMA foreign_keys=OFF")
            raw.execute("PRAGMA busy_timeout = 0")
            await _begin_immediate(raw, wait)
            raw.execute(f"PRAGMA busy_timeout = {SQLITE_READ_BUSY_MS}")
            conn.begin()  # SQLAlchemy's view of the transaction BEGIN IMMEDIATE opened
        except BaseException:
            conn.close()
            raise
        return conn

    async def _sqlite_writer_begin(self) -> Connection:
        """The process's writer connection, in a new ``BEGIN IMMEDIATE`` transaction.

        Inline writes run one at a time (``_WriteLock``), so one connection serves them all;
        kept out of the pool, it costs no checkout and no reset per write, and its busy
        timeout stays 0 (the wait for another process's write lock is ``_begin_immediate``'s,
        on the event loop) instead of being set and restored around every ``BEGIN``: together
        about a sixth of a turn's time on SQLite. Statements inside a write transaction hold
        the write lock and do not wait on other connections.

        SQLAlchemy is not told of the transaction: a write whose statements are all
        ``Prepared`` never needs its view of one, whose begin and commit were about a tenth of
        such a write's CPU. A statement sent SQLAlchemy's ordinary way begins that view itself
        (autobegin; the ``begin`` hook finds SQLite's transaction open and sends nothing), and
        ``write`` then commits through it.
        """
        writer = self._writer
        if writer is None:
            assert self._sqlite is not None
            writer = self._sqlite.connect()
            try:
                _raw(writer).execute("PRAGMA busy_timeout = 0")
            except BaseException:
                writer.close()
                raise
            self._writer = writer
        await _begin_immediate(_raw(writer), self.timeouts.statement)
        return writer

    def _roll_back_writer(self, writer: Connection) -> None:
        """A write that did not commit (an error, a refusal such as a stale claim, a
        cancellation): roll it back and keep the connection for the next write. If the
        rollback fails or leaves SQLite inside a transaction (a failed commit can), the
        connection goes instead, and SQLite rolls back as it closes."""
        try:
            writer.rollback()  # SQLAlchemy's view of it, if an ordinary statement began one
            raw = _raw(writer)
            if raw.in_transaction:
                raw.rollback()
            if not raw.in_transaction:
                return
        except Exception:
            log.warning("SQLite writer connection replaced after a failed rollback", exc_info=True)
        self._writer = None
        writer.invalidate()
        writer.close()

    @contextlib.asynccontextmanager
    async def advisory_lock(self, key: int) -> AsyncIterator[None]:
        """Hold a PostgreSQL session-level advisory lock (replicas migrating one at a time).

        On SQLite there is nothing to take: every writer already holds the write lock.
        """
        if self._async is None:
            yield
            return
        try:
            async with self._schema_engine().connect() as aconn:
                await aconn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
                await aconn.commit()
                try:
                    yield
                finally:
                    await aconn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                    await aconn.commit()
        except (SQLAlchemyError, OSError) as exc:
            raise database_error(exc) from exc

    async def warm(self) -> None:
        """Open, before a process listens, the connections its first acknowledgement would
        otherwise open inside its 2.5 s: on PostgreSQL a held connection (``autocommit``), a
        pooled one (``read``) and an urgent one (the record's write), each engine's first
        connection also running SQLAlchemy's dialect initialisation and every connection
        asyncpg's codec set-up, several round trips each, on a fresh server backend. A
        loaded machine stretched those past the deadline on a replica's first message
        (answered 503; tests/test_warm_start.py). On SQLite, the readers (opening a file is
        cheap; the writer is not opened, which would wait for another process's write lock).

        The three are opened at once (each checks out before any connects), so they are
        three connections, and stay open in their pools. On the event loop that will use
        them: held connections belong to the first loop that takes one."""
        ping = text("SELECT 1")
        if self._sqlite is not None:
            with self.sqlite_reader() as reader:
                reader.execute("SELECT 1").fetchall()
            async with self.read() as conn:
                await conn.execute(ping)
            return

        async def one(opened: contextlib.AbstractAsyncContextManager[Conn]) -> None:
            async with opened as conn:
                await conn.execute(ping)

        opened = await asyncio.gather(
            one(self.autocommit()),
            one(self.read()),
            one(self.autocommit(urgent=True)),
            return_exceptions=True,
        )
        for failed in opened:  # all three ended (none left opening after a failure)
            if isinstance(failed, BaseException):
                raise failed

    async def answers(self) -> bool:
        """Health check for load balancers: a read of a real table, within a few seconds."""
        return (await self.probe()).answered

    async def probe(self) -> Probe:
        """A read of a real table (the schema's revision), within a few seconds: whether the
        database answers, and at which revision (readiness wants both from one statement).

        SQLite: on a new connection that may not create the file, because pooled connections
        keep reading a file that was deleted or whose volume went away."""
        query = "SELECT version_num FROM alembic_version LIMIT 1"
        try:
            if self._sqlite is not None:
                with contextlib.closing(
                    sqlite3.connect(self._sqlite_uri, uri=True, timeout=1.0)
                ) as probe:
                    rows = probe.execute(query).fetchall()
            else:
                async with asyncio.timeout(HEALTH_TIMEOUT_SECONDS), self.read() as conn:
                    rows = list((await conn.execute(text(query))).all())
        except (DatabaseError, TimeoutError, sqlite3.Error) as exc:
            # A database never migrated answers, with no schema: not "unavailable".
            return Probe(answered=_no_such_table(exc), revision=None)
        return Probe(answered=True, revision=str(rows[0][0]) if rows else None)

    def upsert(self, table: Table) -> postgresql.Insert | sqlite.Insert:
        """INSERT with ``on_conflict_do_*`` (both dialects spell it the same, from their module)."""
        if self.dialect == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    async def dispose(self) -> None:
        held, self._held = self._held, []
        for conn in held:
            self._holding -= 1
            with contextlib.suppress(SQLAlchemyError, OSError, RuntimeError):  # RuntimeError:
                await conn.close()  # disposed from another event loop than theirs
        self._held_loop = None
        if self._reader is not None:
            self._reader.invalidate()
            self._reader = None
        if self._writer is not None:
            self._writer.invalidate()  # its busy timeout is not the pool's
            self._writer.close()
            self._writer = None
        if self._sqlite is not None:
            self._sqlite.dispose()
        if self._async is not None:
            await self._async.dispose()
        if self._urgent is not None:
            await self._urgent.dispose()
        if self._schema is not None:
            await self._schema.dispose()


def check_sqlite_version() -> None:
    """Refuse, in one line, a SQLite older than ``MIN_SQLITE`` (the library Python links)."""
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        needed = ".".join(map(str, MIN_SQLITE))
        raise ConfigError(
            f"DATABASE_URL: SQLite {sqlite3.sqlite_version} is too old; slack-agent needs "
            f"SQLite {needed} or newer (the library Python's sqlite3 module uses), or PostgreSQL"
        )


async def _begin_immediate(raw: Any, wait: float) -> None:
    """``BEGIN IMMEDIATE`` on a connection whose busy timeout is 0, retried with
    ``asyncio.sleep`` while another process holds the write lock (module docstring)."""
    delay, waited = 0.001, 0.0
    while True:
        try:
            raw.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if waited >= wait:
                raise
        await asyncio.sleep(delay)
        waited += delay
        delay = min(delay * 2, 0.05)


def _sqlite_file(path: str) -> str:
    """The URI every connection opens SQLite by: read-write, never creating the file.

    The file is created here, once, if it does not exist yet. A connection that could create it
    and was opened while the file was away (deleted, renamed, its volume gone) would make an
    empty database in its place and keep it, pooled, after the real one was back; it fails
    instead, and the next one finds the file. An in-memory database is refused: every
    connection would see a database of its own.
    """
    if path in ("", ":memory:"):
        raise ConfigError(
            f"DATABASE_URL: SQLite needs a file path (got {path or 'an in-memory database'!r})"
        )
    if not Path(path).exists():
        try:
            sqlite3.connect(path).close()  # an empty file: SQLite's empty database
        except sqlite3.Error as exc:
            raise ConfigError(
                f"DATABASE_URL: cannot create the SQLite file {path}: {exc}"
            ) from None
    return f"file:{urllib.parse.quote(str(Path(path).resolve()))}?mode=rw"


def _no_such_table(exc: BaseException) -> bool:
    """The statement named a table the database does not have (SQLite's message, PostgreSQL's
    SQLSTATE 42P01), under our ``DatabaseError`` (``database_error``'s ``from``) or not."""
    cause = exc.__cause__ if isinstance(exc, DatabaseError) and exc.__cause__ else exc
    cause = getattr(cause, "orig", None) or cause
    if isinstance(cause, sqlite3.OperationalError):
        return str(cause).startswith("no such table")
    return _sqlstate(cause) == "42P01"


def _raw(conn: Connection) -> Any:
    return conn.connection.dbapi_connection


def database_error(exc: BaseException) -> DatabaseError:
    """One line naming the driver's complaint, without SQLAlchemy's SQL echo and links.

    A value the database refused (``_refused_state``) is a ``DatabaseValueRefused``: the
    request's fault, refused again if sent again, where every other failure may pass."""
    cause = getattr(exc, "orig", None) or exc
    detail = (str(cause).strip().splitlines() or [""])[0]
    if not detail and isinstance(cause, TimeoutError):
        detail = "the database did not answer within its time limit"
    state = _refused_state(cause)
    if state is not None:
        return DatabaseValueRefused(f"the database refused a value ({state}): {detail}")
    return DatabaseError(f"{cause.__class__.__name__}: {detail}")


def _refused_state(cause: BaseException) -> str | None:
    """The SQLSTATE when the database refused a value itself, else None.

    PostgreSQL: class 22, "data exception" (22021: a NUL in a text; 22003: a number out of
    range), which SQLAlchemy's asyncpg adapter carries as ``sqlstate`` on the error it wraps
    (``exc.orig``). SQLite stores a NUL and any text; its ``DataError`` (a value too big to
    store) is the same refusal, named by the class SQLite's error code falls in."""
    state = _sqlstate(cause)
    if state is not None and state.startswith("22"):
        return state
    if isinstance(cause, sqlite3.DataError):
        return "22000"
    return None


def _sqlstate(cause: BaseException) -> str | None:
    """PostgreSQL's SQLSTATE of a driver error: SQLAlchemy's asyncpg adapter carries it as
    ``sqlstate`` on the error it wraps (``exc.orig``)."""
    state = getattr(cause, "sqlstate", None)
    return state if isinstance(state, str) else None


def library_engine(url: str, timeouts: DatabaseTimeouts | None = None) -> Any:
    """An async engine on ``url`` for a library that brings its own tables and statements
    (slack_sdk's installation and OAuth state stores), its calls bounded like ours. ``Any`` on
    purpose: what is above the storage layer hands it to that library and never uses it."""
    url = normalize_database_url(url)
    bounds = timeouts or DatabaseTimeouts()
    if url.startswith("sqlite"):
        return create_async_engine(url, connect_args={"timeout": bounds.statement})
    return bounded_engine(url, bounds, server_settings=bounds.server_settings())


def _closed_by_server(dbapi_conn: Any) -> bool:
    """Whether the server ended this idle connection (a restart, a failover, an operator's
    ``pg_terminate_backend``): asyncpg marks it closed as soon as the loop reads the end, so
    asking costs no round trip (a pre-ping costs one per checkout)."""
    is_closed = getattr(getattr(dbapi_conn, "driver_connection", None), "is_closed", None)
    return bool(is_closed()) if callable(is_closed) else False


def _ended_by_server(held: AsyncConnection) -> bool:
    """A held connection the server ended while it sat idle (``_closed_by_server``). Without
    this look every held connection failed one statement after a restart, the first use of
    each finding it dead: ten failures in a process holding ten (2026-12-05)."""
    sync = held.sync_connection
    if sync is None or sync.invalidated or sync.closed:
        return True
    return _closed_by_server(sync.connection.dbapi_connection)


# The longest statement asyncpg keeps prepared on a connection (its default is 15 KiB). A
# budgeted claim's one statement (``core.storage.reservations``: the rules in SQL for every
# budget, the claim, the reservation, the message) is about that long with three budgets and
# longer with more; past the limit asyncpg parses and plans it at every run, unnamed, which
# cost more (about 2.5 ms) than the whole claim.
CACHEABLE_STATEMENT_CHARS: Final = 256 * 1024


def bounded_engine(
    url: str, timeouts: DatabaseTimeouts, *, server_settings: dict[str, str], **kwargs: Any
) -> AsyncEngine:
    """A PostgreSQL engine whose every call is bounded (``DatabaseTimeouts``)."""
    engine = create_async_engine(
        url,
        json_deserializer=json_loads,
        connect_args={
            "timeout": timeouts.connect,
            "command_timeout": timeouts.statement,
            "server_settings": server_settings,
            "max_cacheable_statement_size": CACHEABLE_STATEMENT_CHARS,
        },
        **kwargs,
    )
    keepalive = timeouts.keepalive

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        _keep_alive(dbapi_conn, *keepalive)

    @event.listens_for(engine.sync_engine, "checkout")
    def _on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        # An idle connection the server ended (``_closed_by_server``): the pool opens a new
        # one in its place instead of lending it, for transactions and held connections alike.
        if _closed_by_server(dbapi_conn):
            raise DisconnectionError("the server ended this connection while it was idle")

    @event.listens_for(engine.sync_engine, "handle_error")
    def _on_error(context: ExceptionContext) -> None:
        # A statement that timed out left its connection mid-command (asyncpg would wait for
        # the cancellation, on the same dead path, before the next one): drop it.
        if isinstance(context.original_exception, TimeoutError):
            context.is_disconnect = True

    return engine


def _keep_alive(dbapi_conn: Any, idle: int, interval: int, probes: int) -> None:
    """TCP keepalive on the client's end of a PostgreSQL connection (Linux's options where
    the platform has them): a connection whose peer vanished while it idled in the pool fails
    at its next use instead of hanging."""
    driver = getattr(dbapi_conn, "driver_connection", None)
    transport = getattr(driver, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", idle),
            ("TCP_KEEPINTVL", interval),
            ("TCP_KEEPCNT", probes),
        ):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def create_database(
    url: str,
    *,
    echo: bool = False,
    pool_size: int = 10,
    synchronous_commit: bool = True,
    timeouts: DatabaseTimeouts | None = None,
) -> Database:
    """The database for ``url`` (normalised and checked, see ``normalize_database_url``)."""
    return Database(
        url,
        echo=echo,
        pool_size=pool_size,
        synchronous_commit=synchronous_commit,
        timeouts=timeouts,
    )


def _use_wal(dbapi_conn: Any) -> None:
    """Put the file in WAL mode (a no-op once it is). Switching a fresh file needs it to itself,
    and SQLite refuses at once, without waiting, when another process holds a lock that waiting
    could deadlock on (replicas starting together on a new file): so retry, briefly, here. This
    runs once per new connection and waits only in that start-up race."""
    deadline = time.monotonic() + SQLITE_WRITE_WAIT_SECONDS
    while True:
        try:
            if dbapi_conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                dbapi_conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def sqlite_settings(dbapi_conn: sqlite3.Connection) -> None:
    """What every SQLite connection of the product runs with: transactions begun explicitly
    (pysqlite's own BEGIN is always deferred), the readers' busy timeout, WAL, foreign keys,
    ``synchronous=NORMAL``. Also for a tool that runs the product's statements on a bare
    connection (``slack-agent bench write-replay``), so its figures are the product's."""
    dbapi_conn.isolation_level = None
    dbapi_conn.execute(f"PRAGMA busy_timeout={SQLITE_READ_BUSY_MS}")
    _use_wal(dbapi_conn)
    dbapi_conn.execute("PRAGMA foreign_keys=ON")
    dbapi_conn.execute("PRAGMA synchronous=NORMAL")


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        sqlite_settings(dbapi_conn)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Writers already hold BEGIN IMMEDIATE (Database.write); readers begin deferred.
        if not _raw(conn).in_transaction:
            conn.exec_driver_sql("BEGIN")
