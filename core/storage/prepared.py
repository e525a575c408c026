"""Statements built and compiled once and run on the driver itself, where SQLAlchemy's own
work is most of their cost.

A turn runs a few dozen small statements: its own (the claim, the stale-guarded insert, the
fence and the answer's insert) and the bookkeeping around it (the delivery record and its
moves, the session and thread look-ups, the usage ledger's row, the stop poll). Through
SQLAlchemy each costs several times what SQLite's own work takes: building the statement, the
compiled-cache lookup, the execution context, the events and the result object are the rest
(docs/benchmarks.md, *Figures behind choices in the code* and *A turn's own CPU*). A
``Prepared`` statement is built once (at import, every varying value a ``bindparam``), compiled
for the connection's dialect once, with its parameters' order, its literal values and its
types' bind and result processors (JSON, UTC datetimes, booleans), and then runs as the
driver's own call with the same SQL SQLAlchemy would send, its rows processed as SQLAlchemy
would.

It takes that path only where it changes nothing observable: an ``InlineConnection`` (SQLite,
statements in place on the event loop) or a PostgreSQL ``AsyncConnection`` whose engine nobody
watches. When anything listens to the engine's statement events or echoes SQL (a test counting
statements, an operator's tracing), and in a worker thread, the statement goes SQLAlchemy's
ordinary way. On PostgreSQL it runs on asyncpg inside the transaction SQLAlchemy has open (begun
first if it is the transaction's first statement, as SQLAlchemy's adapter would), or, in a read
with no transaction yet, on its own (one statement is consistent by itself, and the BEGIN and
ROLLBACK round trips are saved). Driver errors are wrapped as SQLAlchemy's, so callers catch
``IntegrityError`` alike on every path.
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import asyncpg
from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Connection,
    Delete,
    Engine,
    Insert,
    Select,
    Update,
    literal,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler

from core.storage.engine import Conn, Database, InlineConnection

Statement = Insert | Update | Delete | Select[Any] | CompoundSelect[Any]


class Ran(NamedTuple):
    """What a hot-path statement did: rows changed, and the first row if any."""

    rowcount: int
    row: tuple[Any, ...] | None


class _Compiled(NamedTuple):
    sql: str
    # Per positional parameter: its name, whether the caller gives it (else its literal value
    # compiled into the statement), and its type's bind processor (None: passed as is).
    params: tuple[tuple[str, bool, Any, Callable[[Any], Any] | None], ...]
    # Per result column, its type's result processor (None: as the driver gives it); empty
    # when the statement returns no rows.
    results: tuple[Callable[[Any], Any] | None, ...]
    # The rows ``Prepared.rows`` gives: named by the statement's result columns.
    row: type[tuple[Any, ...]]

    # Whether a given parameter appears more than once (a multi-row VALUES naming one value
    # in every row): then each is processed once per run, not once per appearance.
    repeats: bool = False

    def values(self, params: dict[str, Any]) -> list[Any]:
        values = []
        if self.repeats:
            done: dict[str, Any] = {}
            for name, given, constant, process in self.params:
                if not given:
                    values.append(constant if process is None else process(constant))
                elif name in done:
                    values.append(done[name])
                else:
                    value = params[name]
                    done[name] = value if process is None else process(value)
                    values.append(done[name])
            return values
        for name, given, constant, process in self.params:
            value = params[name] if given else constant
            values.append(value if process is None else process(value))
        return values

    def processed(self, raw: Sequence[Any]) -> tuple[Any, ...]:
        """A driver's row as SQLAlchemy's ordinary way gives it (JSON decoded, UTC datetimes,
        booleans), named by column."""
        return tuple.__new__(
            self.row,
            [
                value if process is None else process(value)
                for value, process in zip(raw, self.results, strict=True)
            ],
        )


class Prepared:
    """One statement, run through ``Prepared.run``, ``Prepared.rows`` or ``Prepared.all``; see
    the module docstring.

    Build it once (at import) from a statement whose every varying value is a ``bindparam``,
    and never with an IN list of bound values (``expanding``): the SQL is compiled once, as is.
    A constant IN list is written with one bound literal per value (``literal``), not a Python
    tuple, which SQLAlchemy would expand at execution. Result columns must be of types whose
    result processing does not depend on the driver's column type (all but ``Numeric``)."""

    def __init__(self, statement: Statement) -> None:
        self.statement = statement
        self._compiled: dict[str, _Compiled] = {}  # per dialect name

    async def run(self, conn: Conn, params: dict[str, Any]) -> Ran:
        """Rows changed (or returned), and the first row returned, processed like SQLAlchemy's
        (JSON decoded, datetimes in UTC) and named by column (``row.id``) on every path."""
        if type(conn) is InlineConnection and not _watched(conn.sync_connection):
            rowcount, rows = self._inline(conn, params, first=True)
        elif (direct := _asyncpg(conn)) is not None:
            rowcount, rows = await self._on_asyncpg(conn, direct, params)
        else:
            result = await conn.execute(self.statement, params)
            row = result.first() if result.returns_rows else None
            named = self._compile(conn.dialect).row
            return Ran(result.rowcount, None if row is None else tuple.__new__(named, row))
        compiled = self._compiled[conn.dialect.name]
        return Ran(rowcount, compiled.processed(rows[0]) if rows else None)

    async def rows(self, conn: Conn, params: dict[str, Any]) -> Sequence[Any]:
        """Every row returned, processed like SQLAlchemy's, each read by index or by column
        name (``row.id``) like SQLAlchemy's ``Row``."""
        if type(conn) is InlineConnection and not _watched(conn.sync_connection):
            _, rows = self._inline(conn, params, first=False)
        elif (direct := _asyncpg(conn)) is not None:
            _, rows = await self._on_asyncpg(conn, direct, params)
        else:
            return (await conn.execute(self.statement, params)).all()
        processed = self._compiled[conn.dialect.name].processed
        return [processed(row) for row in rows]

    async def all(self, conn: Conn, params: dict[str, Any]) -> Sequence[Sequence[Any]]:
        """Every row of a query, as the driver returned it: no result processing on any path
        (select a JSON column ``cast`` to text and decode it). For reads that grow with the
        data, where SQLAlchemy's per-row work is most of the cost (a history load:
        docs/benchmarks.md, *History load of 10,000 messages*)."""
        if type(conn) is InlineConnection and not _watched(conn.sync_connection):
            return self._inline(conn, params, first=False)[1]
        if (direct := _asyncpg(conn)) is not None:
            return (await self._on_asyncpg(conn, direct, params))[1]
        return (await conn.execute(self.statement, params)).all()

    async def fetch(
        self, db: Database, params: dict[str, Any], *, raw: bool = False
    ) -> Sequence[Any]:
        """Every row of this statement run as a read of its own, processed as ``rows``
        processes them (``raw``: as the driver gives them, as ``all`` does): for the reads of
        one statement, most of a turn's.

        On SQLite, when nobody watches the engine's statements, it runs in place on the
        process's reader connection, outside any transaction (``Database.sqlite_reader``), and
        otherwise in a read transaction; on PostgreSQL on one of the connections held outside
        any transaction (``Database.autocommit``)."""
        engine = db.sync_engine
        if engine.dialect.name != "sqlite" or _engine_watched(engine):
            # SQLite's autocommit() is a write transaction: a read takes read()'s.
            opened = db.autocommit() if engine.dialect.name != "sqlite" else db.read()
            async with opened as conn:
                return await (self.all if raw else self.rows)(conn, params)
        with db.sqlite_reader() as reader:
            _, rows = self._on_sqlite(reader, engine.dialect, params, first=False)
        if raw:
            return rows
        processed = self._compile(engine.dialect).processed
        return [processed(row) for row in rows]

    def _inline(
        self, conn: InlineConnection, params: dict[str, Any], *, first: bool
    ) -> tuple[int, Sequence[Any]]:
        raw = conn.sync_connection.connection.dbapi_connection
        return self._on_sqlite(raw, conn.dialect, params, first=first)

    def _on_sqlite(
        self, raw: Any, dialect: Dialect, params: dict[str, Any], *, first: bool
    ) -> tuple[int, Sequence[Any]]:
        compiled = self._compile(dialect)
        values = compiled.values(params)
        cursor = raw.cursor()
        try:
            cursor.execute(compiled.sql, values)
            if cursor.description is None:
                return cursor.rowcount, []
            if first:
                row = cursor.fetchone()
                return cursor.rowcount, [] if row is None else [row]
            return cursor.rowcount, cursor.fetchall()
        except sqlite3.Error as exc:
            raise DBAPIError.instance(compiled.sql, values, exc, sqlite3.Error) from exc
        finally:
            cursor.close()

    async def _on_asyncpg(
        self, conn: Conn, direct: _Direct, params: dict[str, Any]
    ) -> tuple[int, Sequence[Any]]:
        """The statement on the pooled connection's asyncpg connection, inside the transaction
        SQLAlchemy has open on it: begun here if this is its first statement, as SQLAlchemy's
        adapter would (a read outside any transaction runs on its own: one statement is
        consistent by itself, and saves the BEGIN and ROLLBACK round trips). Bounded like every
        statement (asyncpg's ``command_timeout``); errors reach the caller as SQLAlchemy's
        (``IntegrityError`` …), and a connection that timed out or broke is invalidated, as
        the engine's error hook does on the other path."""
        compiled = self._compile(conn.dialect)
        values = compiled.values(params)
        adapted, driver, begin = direct
        try:
            async with adapted._execute_mutex:
                if begin and adapted._transaction is None:
                    await adapted._start_transaction()  # raises the adapter's error
                if compiled.results:
                    rows = await driver.fetch(compiled.sql, *values)
                    return len(rows), rows
                status = await driver.execute(compiled.sql, *values)
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            translated = _translated(adapted, exc)
            if driver.is_closed():
                await _invalidate(conn)
            raise DBAPIError.instance(
                compiled.sql, values, translated, conn.dialect.loaded_dbapi.Error
            ) from exc
        except DBAPIError:
            raise
        except conn.dialect.loaded_dbapi.Error as exc:  # from _start_transaction
            if driver.is_closed():
                await _invalidate(conn)
            raise DBAPIError.instance(
                compiled.sql, values, exc, conn.dialect.loaded_dbapi.Error
            ) from exc
        except OSError:  # TimeoutError included: the connection is mid-command or gone
            await _invalidate(conn)
            raise
        count = status.rpartition(" ")[2]  # "UPDATE 1", "INSERT 0 1"
        return (int(count) if count.isdigit() else -1), []

    def _compile(self, dialect: Dialect) -> _Compiled:
        found = self._compiled.get(dialect.name)
        if found is not None:
            return found
        compiled = self.statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        assert compiled.positiontup is not None
        params = []
        for name in compiled.positiontup:
            bind = compiled.binds[name]
            assert not bind.expanding, f"{name}: an expanding parameter cannot be prepared"
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            params.append((name, bool(bind.required), bind.value, process))
        columns = compiled._result_columns
        results = tuple(
            column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns
        )
        row = collections.namedtuple(  # type: ignore[misc]
            "PreparedRow", [column.keyname for column in columns], rename=True
        )
        given = [name for name, required, _, process in params if required and process]
        found = _Compiled(str(compiled), tuple(params), results, row, len(given) != len(set(given)))
        self._compiled[dialect.name] = found
        return found


class _Direct(NamedTuple):
    adapted: Any  # SQLAlchemy's adapter of the asyncpg connection
    driver: asyncpg.Connection
    begin: bool  # SQLAlchemy has a transaction open: the statement runs inside it


def _asyncpg(conn: Conn) -> _Direct | None:
    """An unwatched PostgreSQL connection's asyncpg connection, where a statement may bypass
    SQLAlchemy's execution; None: the ordinary way (watched, not yet connected, invalidated,
    or an adapter without what this relies on)."""
    if not isinstance(conn, AsyncConnection):
        return None
    sync = conn.sync_connection
    if sync is None or sync.closed or sync.invalidated or _watched(sync):
        return None
    adapted = sync.connection.dbapi_connection
    driver = getattr(adapted, "driver_connection", None)
    if not isinstance(driver, asyncpg.Connection) or not hasattr(adapted, "_start_transaction"):
        return None
    return _Direct(adapted, driver, sync.in_transaction())


def direct_driver(conn: Conn) -> asyncpg.Connection | None:
    """The asyncpg connection under ``conn`` where a statement may bypass SQLAlchemy's
    execution (``_asyncpg``); None: the ordinary way."""
    direct = _asyncpg(conn)
    return None if direct is None else direct.driver


def _translated(adapted: Any, exc: Exception) -> Exception:
    """An asyncpg error as the DBAPI error SQLAlchemy's adapter makes of it (a unique
    violation is an ``IntegrityError``, …), so ``DBAPIError.instance`` wraps it alike."""
    try:
        adapted._handle_exception(exc)
    except Exception as translated:  # what it raises is the translation
        return translated
    return exc


async def _invalidate(conn: Conn) -> None:
    assert isinstance(conn, AsyncConnection)
    await conn.invalidate()


def _watched(sync: Connection | None) -> bool:
    """Whether anyone would miss a statement that bypasses SQLAlchemy's execution: statement
    listeners on the engine or this connection, or SQL echo."""
    if sync is None:  # an async connection not yet connected: the ordinary way
        return True
    return bool(
        _engine_watched(sync.engine)
        or sync.dispatch.before_cursor_execute
        or sync.dispatch.after_cursor_execute
    )


def _engine_watched(engine: Engine) -> bool:
    """Statement listeners on the engine, or SQL echo (``_watched``)."""
    dispatch = engine.dispatch
    return bool(
        engine.echo
        or dispatch.before_cursor_execute
        or dispatch.after_cursor_execute
        or dispatch.before_execute
        or dispatch.after_execute
    )


def constant_in(column: ColumnElement[Any], values: Sequence[Any]) -> ColumnElement[bool]:
    """``column IN (values)`` for a constant list, written so it compiles once: SQLAlchemy
    expands an IN list of plain values at execution, which a ``Prepared`` statement cannot."""
    return column.in_([literal(value, column.type) for value in values])


def constant_not_in(column: ColumnElement[Any], values: Sequence[Any]) -> ColumnElement[bool]:
    """``column NOT IN (values)``, as ``constant_in``."""
    return column.not_in([literal(value, column.type) for value in values])
