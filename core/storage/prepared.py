"""Statements of a turn's hot path, compiled once and run on SQLite's own cursor.

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
tracing), and on PostgreSQL (where the round trip dominates) and in a worker thread, the
statement goes SQLAlchemy's ordinary way. Driver errors are wrapped as SQLAlchemy's, so
callers catch ``IntegrityError`` alike on both paths.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, NamedTuple

from sqlalchemy import Insert, Select, Update
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DBAPIError
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


class Prepared:
    """One statement, run through ``Prepared.run``; see the module docstring."""

    def __init__(self, statement: Insert | Update | Select[Any]) -> None:
        self.statement = statement
        self._sqlite: _Compiled | None = None

    async def run(self, conn: Conn, params: dict[str, Any]) -> Ran:
        if type(conn) is InlineConnection and not _watched(conn):
            return self._run_inline(conn, params)
        result = await conn.execute(self.statement, params)
        row = result.first() if result.returns_rows else None
        return Ran(result.rowcount, None if row is None else tuple(row))

    def _run_inline(self, conn: InlineConnection, params: dict[str, Any]) -> Ran:
        compiled = self._sqlite or self._compile(conn.dialect)
        values = []
        for name, given, literal, process in compiled.params:
            value = params[name] if given else literal
            values.append(value if process is None else process(value))
        cursor = conn.sync_connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(compiled.sql, values)
            row = cursor.fetchone() if cursor.description is not None else None
            return Ran(cursor.rowcount, None if row is None else tuple(row))
        except sqlite3.Error as exc:
            raise DBAPIError.instance(compiled.sql, values, exc, sqlite3.Error) from exc
        finally:
            cursor.close()

    def _compile(self, dialect: Dialect) -> _Compiled:
        compiled = self.statement.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)
        assert compiled.positiontup is not None
        params = []
        for name in compiled.positiontup:
            bind = compiled.binds[name]
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            params.append((name, bool(bind.required), bind.value, process))
        self._sqlite = _Compiled(str(compiled), tuple(params))
        return self._sqlite


def _watched(conn: InlineConnection) -> bool:
    """Whether anyone would miss a statement that bypasses SQLAlchemy's execution: statement
    listeners on the engine or this connection, or SQL echo."""
    sync = conn.sync_connection
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
