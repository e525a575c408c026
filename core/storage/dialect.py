"""The SQL pieces that differ per database: the clock, UTC datetimes, a fork's ids, JSON edits.

Each is a SQLAlchemy construct compiled one way for SQLite and another for PostgreSQL, so the
statements of the storage modules read the same on both. All time that decides anything (lock
staleness, expiry, idleness) is the database's clock (``db_now``), so replicas with skewed
clocks agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Self

from sqlalchemy import BigInteger, Boolean, ColumnElement, DateTime, String, Table, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect, Row
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.sql.operators import OperatorType
from sqlalchemy.types import TypeDecorator

from core.storage.engine import Conn
from core.storage.prepared import Prepared

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


class greater_of(FunctionElement[int]):
    """The greater of two integers (SQLite's two-argument ``max``, PostgreSQL's ``GREATEST``).
    A NULL argument gives NULL on SQLite and is ignored on PostgreSQL: use it where both
    read the same, such as inside a ``sum``, which skips NULLs, of values at least 0."""

    type = BigInteger()
    inherit_cache = True
    name = "greater_of"


@compiles(greater_of, "sqlite")
def _sqlite_greater_of(element: greater_of, compiler: SQLCompiler, **kw: Any) -> str:
    return f"max({compiler.process(element.clause_expr, **kw)[1:-1]})"


@compiles(greater_of, "postgresql")
def _pg_greater_of(element: greater_of, compiler: SQLCompiler, **kw: Any) -> str:
    return f"GREATEST({compiler.process(element.clause_expr, **kw)[1:-1]})"


class lesser_of(FunctionElement[int]):
    """The least of integers (SQLite's many-argument ``min``, PostgreSQL's ``LEAST``). NULL
    arguments read as ``greater_of``'s do: use it where none is NULL."""

    type = BigInteger()
    inherit_cache = True
    name = "lesser_of"


@compiles(lesser_of, "sqlite")
def _sqlite_lesser_of(element: lesser_of, compiler: SQLCompiler, **kw: Any) -> str:
    return f"min({compiler.process(element.clause_expr, **kw)[1:-1]})"


@compiles(lesser_of, "postgresql")
def _pg_lesser_of(element: lesser_of, compiler: SQLCompiler, **kw: Any) -> str:
    return f"LEAST({compiler.process(element.clause_expr, **kw)[1:-1]})"


class copied_message_id(FunctionElement[str]):
    """A version 7 UUID in canonical text, made by the database for each row a fork copies.

    ``copied_message_id(position, nonce, millis)``: the milliseconds, then the row's position
    (so a copy's ids are ordered like its rows and land at the right edge of the ``message_id``
    index), then ``nonce``, 10 hex digits random per statement; the layout of
    ``core.messages.new_message_id``. ``millis`` is the statement's clock, read in Python like
    every other message id's. The value is a function of the row, so evaluating it twice (for
    the column and inside the JSON) gives the same id and the copy needs no CTE: every
    reference to a non-materialised CTE column is evaluated again (SQLite 3.31 has no
    ``MATERIALIZED``), and a materialised one is a second copy of the prefix (PostgreSQL:
    docs/benchmarks.md, *``branch`` of 10,000 messages*). SQLite formats it in one ``printf``;
    PostgreSQL with ``lpad(to_hex(…))``, the same digits.
    """

    type = String(36)
    inherit_cache = True
    name = "copied_message_id"


@compiles(copied_message_id, "sqlite")
def _sqlite_copied_message_id(element: copied_message_id, compiler: SQLCompiler, **kw: Any) -> str:
    position, nonce, millis = (compiler.process(arg, **kw) for arg in element.clauses)
    return (
        f"(printf('%08x-%04x-7%03x-8%03x-%02x', {millis} >> 16, {millis} & 65535, "
        f"({position} >> 20) & 4095, ({position} >> 8) & 4095, {position} & 255) || {nonce})"
    )


@compiles(copied_message_id, "postgresql")
def _pg_copied_message_id(element: copied_message_id, compiler: SQLCompiler, **kw: Any) -> str:
    position, nonce, millis = (compiler.process(arg, **kw) for arg in element.clauses)

    def hex_digits(value: str, width: int) -> str:
        return f"lpad(to_hex({value}), {width}, '0')"

    return (
        f"({hex_digits(f'{millis} >> 16', 8)} || '-' || {hex_digits(f'{millis} & 65535', 4)}"
        f" || '-7' || {hex_digits(f'({position} >> 20) & 4095', 3)}"
        f" || '-8' || {hex_digits(f'({position} >> 8) & 4095', 3)}"
        f" || '-' || {hex_digits(f'{position} & 255', 2)} || {nonce})"
    )


class json_with_id(FunctionElement[Any]):
    """``json_with_id(message, new_id, old_id)``: ``message`` with its ``id`` (``old_id``, which
    ``message_id`` always equals) replaced; copies a UIMessage under a new id in SQL.

    SQLite edits the document with ``json_set``. PostgreSQL stores a message as ``json`` (its
    text), whose only editor is ``jsonb_set`` on a conversion to JSONB and back: a parse and a
    write of every copied document, 30-40 ms more for a 10,000-message fork. But a stored
    message starts with ``{"id": "<its id>"``: ``json.dumps`` keeps a dict's order, and ours
    put ``id`` first (``core.messages``); JSONB, which the migration to ``json`` converted
    from, writes the shortest key first. So there the characters up to the id's closing
    quote are replaced by the same with the new id, and the rest of the text is kept: the same
    document as ``jsonb_set`` makes, for no parse but the cast's validation. A document that
    starts otherwise (its keys in another order, other spacing) goes the JSONB way.
    """

    inherit_cache = True
    name = "json_with_id"


@compiles(json_with_id, "sqlite")
def _sqlite_json_with_id(element: json_with_id, compiler: SQLCompiler, **kw: Any) -> str:
    message, new_id, _old_id = (compiler.process(arg, **kw) for arg in element.clauses)
    return f"json_set({message}, '$.id', {new_id})"


_ID_OPENING = """'{"id": "'"""  # 8 characters, then the id (what follows it is kept)


@compiles(json_with_id, "postgresql")
def _pg_json_with_id(element: json_with_id, compiler: SQLCompiler, **kw: Any) -> str:
    message, new_id, old_id = (compiler.process(arg, **kw) for arg in element.clauses)
    document = f"CAST({message} AS TEXT)"
    return (
        f"CASE WHEN starts_with({document}, {_ID_OPENING} || {old_id} || '\"')"
        f" THEN CAST({_ID_OPENING} || {new_id} || substr({document}, 9 + length({old_id}))"
        " AS JSON)"
        f" ELSE CAST(jsonb_set(CAST({message} AS JSONB), '{{id}}', to_jsonb({new_id})) AS JSON)"
        " END"
    )


class in_json_ids(FunctionElement[bool]):
    """``in_json_ids(column, ids)``: ``column`` is one of ``ids``, a JSON array of integers given
    as one text parameter (``json_ids``). The statement is the same however many ids, so it is
    built and compiled once (``core.storage.prepared``), where an IN list of bound values is
    expanded, and so compiled, per call."""

    type = Boolean()
    inherit_cache = True
    name = "in_json_ids"

    def self_group(self, against: OperatorType | None = None) -> Self:
        """Itself, in a WHERE clause too: SQLAlchemy compares a Boolean function with 1 on
        SQLite (``id IN (…) = 1``), which no index serves: the stop poll scanned every session
        (13 ms a poll at 50,000 sessions, every second) where it now looks up each id. The
        SQL is an ``IN`` already, which binds tighter than AND, OR and NOT."""
        return self


@compiles(in_json_ids, "sqlite")
def _sqlite_in_json_ids(element: in_json_ids, compiler: SQLCompiler, **kw: Any) -> str:
    column, ids = (compiler.process(arg, **kw) for arg in element.clauses)
    return f"{column} IN (SELECT value FROM json_each({ids}))"


@compiles(in_json_ids, "postgresql")
def _pg_in_json_ids(element: in_json_ids, compiler: SQLCompiler, **kw: Any) -> str:
    column, ids = (compiler.process(arg, **kw) for arg in element.clauses)
    return f"{column} IN (SELECT CAST(jsonb_array_elements_text(CAST({ids} AS jsonb)) AS BIGINT))"


def json_ids(ids: Iterable[int]) -> str:
    """The ``ids`` parameter of ``in_json_ids``."""
    return "[" + ",".join(str(int(i)) for i in ids) + "]"


def ago(seconds: float) -> db_now:
    """``db_now() - seconds``: the boundary for staleness and retention checks."""
    return db_now(-float(seconds))


def hence(seconds: float) -> db_now:
    """``db_now() + seconds``: expiry times of temporary sessions."""
    return db_now(float(seconds))


async def update_returning(
    conn: Conn,
    table: Table,
    where: ColumnElement[bool],
    values: dict[str, Any],
    columns: Sequence[ColumnElement[Any]],
    params: dict[str, Any] | None = None,
) -> list[Row[Any]]:
    """``UPDATE table SET values WHERE where RETURNING columns``, on every supported SQLite.

    That one statement where the database has RETURNING (PostgreSQL; SQLite from 3.35, as
    SQLAlchemy's dialect reports). An older SQLite (see ``MIN_SQLITE``): the ids matching, an
    UPDATE of exactly those, and their rows as updated, three statements inside the caller's
    write transaction, which no other writer can interleave with (it holds SQLite's write
    lock), so the effect is the same. ``table`` has an ``id`` primary key.
    """
    if conn.dialect.update_returning:
        stmt = update(table).where(where).values(values).returning(*columns)
        return list(await conn.execute(stmt, params))
    ids = list((await conn.execute(select(table.c.id).where(where), params)).scalars())
    if not ids:
        return []
    await conn.execute(update(table).where(table.c.id.in_(ids)).values(values))
    return list(await conn.execute(select(*columns).where(table.c.id.in_(ids))))


def insert_ignoring(
    table: Table,
    values: dict[str, Any],
    conflict: Sequence[str],
    returning: Sequence[ColumnElement[Any]] = (),
) -> dict[str, Prepared]:
    """``INSERT … ON CONFLICT (conflict) DO NOTHING [RETURNING …]``, prepared once for each
    database by dialect name (the clause is each dialect's own construct). ``values``: bind
    parameters or SQL, so the statement is built once, at import."""
    found: dict[str, Prepared] = {}
    for name, insert in (("sqlite", sqlite.insert), ("postgresql", postgresql.insert)):
        statement = insert(table).values(values).on_conflict_do_nothing(index_elements=conflict)
        found[name] = Prepared(statement.returning(*returning) if returning else statement)
    return found
