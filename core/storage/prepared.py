"""Statements compiled once and run on the driver itself, where SQLAlchemy's own work is most
of their cost.

A turn runs a handful of small statements (the claim, the stale-guarded insert, the fence and
the answer's insert). Through SQLAlchemy each costs several times what SQLite's own work takes:
the compiled-cache lookup, the execution context, the events and the result object are the rest
(docs/benchmarks.md, *Figures behind choices in the code*). A ``Prepared`` statement is compiled for
the connection's dialect once, with its parameters' order, its literal values and its types' bind
processors (JSON serialisation, UTC datetimes), and then runs as ``cursor.execute(sql, values)``:
the same SQL SQLAlchemy would send.

It takes that path only where it pays and changes nothing observable: an ``InlineConnection``
(statements in place on the event loop) whose engine nobody watches. When anything listens to
the engine's statement events or echoes SQL (a test counting statements, an operator's
tracing), and in a worker thread, the statement goes SQLAlchemy's ordinary way; so does a
small statement on PostgreSQL, where the round trip dominates. A read whose rows grow with the
data (``Prepared.all``: a history load) also runs on asyncpg itself on PostgreSQL, since there
SQLAlchemy's per-row work is what dominates. Driver errors are wrapped as SQLAlchemy's, so
callers catch ``IntegrityError`` alike on both paths.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import asyncpg
from sqlalchemy import Connection, Insert, Select, Update
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.compiler import SQLCompiler

from core.storage.engine import Conn, InlineConnection


class Ran(NamedTuple):
    """What a hot-path statement did: rows changed, and the first row if any."""

    rowcount: int
    row: tuple[Any, ...] | None


class _Compiled(NamedTuple):
    sql: str
    # Per positional parameter: its name, whether the caller gives it (else its literal value
    # compiled into the statement), and its type's bind processor (None: passed as is).
    params: tuple[tuple[str, bool, Any, Callable[[Any], Any] | None], ...]

    def values(self, params: dict[str, Any]) -> list[Any]:
        values = []
        for name, given, literal, process in self.params:
            value = params[name] if given else literal
            values.append(value if process is None else process(value))
        return values


class Prepared:
    """One statement, run through ``Prepared.run`` or ``Prepared.all``; see the module
    docstring."""

    def __init__(self, statement: Insert | Update | Select[Any]) -> None:
        self.statement = statement
        self._compiled: dict[str, _Compiled] = {}  # per dialect name

    async def run(self, conn: Conn, params: dict[str, Any]) -> Ran:
        if type(conn) is InlineConnection and not _watched(conn.sync_connection):
            return self._inline(conn, params, all_rows=False)  # type: ignore[return-value]
        result = await conn.execute(self.statement, params)
        row = result.first() if result.returns_rows else None
        return Ran(result.rowcount, None if row is None else tuple(row))

    async def all(self, conn: Conn, params: dict[str, Any]) -> Sequence[Sequence[Any]]:
        """Every row of a query, as the driver returned it: no result processing on any path
        (select a JSON column ``cast`` to text and decode it). For reads that grow with the
        data, where SQLAlchemy's per-row work is most of the cost (a history load:
        docs/benchmarks.md, *History load of 10,000 messages*)."""
        if type(conn) is InlineConnection and not _watched(conn.sync_connection):
            return self._inline(conn, params, all_rows=True)  # type: ignore[return-value]
        if isinstance(conn, AsyncConnection) and not _watched(conn.sync_connection):
            return await self._on_asyncpg(conn, params)
        return (await conn.execute(self.statement, params)).all()

    def _inline(
        self, conn: InlineConnection, params: dict[str, Any], *, all_rows: bool
    ) -> Ran | list[Any]:
        compiled = self._compile(conn.dialect)
        values = compiled.values(params)
        cursor = conn.sync_connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(compiled.sql, values)
            if all_rows:
                return list(cursor.fetchall())
            row = cursor.fetchone() if cursor.description is not None else None
            return Ran(cursor.rowcount, None if row is None else tuple(row))
        except sqlite3.Error as exc:
            raise DBAPIError.instance(compiled.sql, values, exc, sqlite3.Error) from exc
        finally:
            cursor.close()

    async def _on_asyncpg(self, conn: AsyncConnection, params: dict[str, Any]) -> list[Any]:
        """The statement on the pooled connection's asyncpg connection, inside whatever
        transaction SQLAlchemy has open on it (or none: one statement is consistent on its
        own). Bounded like every statement (asyncpg's ``command_timeout``); a connection that
        timed out or broke is invalidated, as the engine's error hook does on the other path."""
        compiled = self._compile(conn.dialect)
        values = compiled.values(params)
        driver: asyncpg.Connection = (await conn.get_raw_connection()).driver_connection
        try:
            return list(await driver.fetch(compiled.sql, *values))
        except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            if driver.is_closed():
                await conn.invalidate()
            raise DBAPIError.instance(compiled.sql, values, exc, Exception) from exc
        except OSError:  # TimeoutError included: the connection is mid-command or gone
            await conn.invalidate()
            raise

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
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            params.append((name, bool(bind.required), bind.value, process))
        self._compiled[dialect.name] = found = _Compiled(str(compiled), tuple(params))
        return found


def _watched(sync: Connection | None) -> bool:
    """Whether anyone would miss a statement that bypasses SQLAlchemy's execution: statement
    listeners on the engine or this connection, or SQL echo."""
    if sync is None:  # an async connection not yet connected: the ordinary way
        return True
    dispatch = sync.engine.dispatch
    return bool(
        sync.engine.echo
        or dispatch.before_cursor_execute
        or dispatch.after_cursor_execute
        or dispatch.before_execute
        or dispatch.after_execute
        or sync.dispatch.before_cursor_execute
        or sync.dispatch.after_cursor_execute
    )
