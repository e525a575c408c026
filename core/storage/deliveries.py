"""Delivery records: a received message, durable from before its acknowledgement.

A surface records every incoming message before it tells the sender "received"; from then on
the record, not a task in some process, is what guarantees an answer. Its life::

    received ──> started ──> done
       │  ▲                    ▲
       ▼  │                    │
     waiting ──> offered ──────┤  (a person clicks Send, or Discard → discarded)
       │         stale ────────┘
       └──> expired            (waited longer than BUSY_POLL_TIMEOUT_SECONDS)

``received``, ``started`` and ``waiting`` are *active*: one process owns the record and renews
its lease (``lease_at``, the database clock) while it works on it. A lease older than the
staleness window means the owner died (or lost the database for that long); any replica may
then take the record over and carry it on: start it, resume its turn, or go on waiting.
``offered`` and ``stale`` are *passive*: nobody owns them; a click claims them, within
``OFFER_TTL_SECONDS`` (then the sweeper deletes them).

What the statements guarantee:

- ``record``: one ``INSERT … ON CONFLICT DO NOTHING``; for one ``(surface, event_key)`` exactly
  one caller on any replica gets the record, so a retry or a double delivery gets None.
- ``take_over``: one conditional UPDATE; a record is moved to the caller only while its lease is
  still lapsed, so two replicas racing for it never both get it (PostgreSQL: ``SKIP LOCKED``,
  and the condition re-checked on the locked row; SQLite: one writer at a time).
- ``refresh``, ``move``, ``release``: conditional on ``owner``: a process whose record was taken
  over changes nothing (the turn lock's fencing protects the transcript the same way).
- ``claim``: a passive record goes to exactly one click.

A message in a thread the surface does not know yet (no record, no session) may be a follow-up
that overtook its thread's first message: Slack delivers events concurrently, and retries a
failed one a minute later. It is recorded as a *stray* (finished, nobody's, kept at most
``STRAY_SECONDS``) and *adopted* (``adopt_strays``: recorded again as received, after the
first message) when a record of its thread is carried on; the stray's own receiver looks again
after writing it, so one of the two always sees the other. Most strays are chatter in threads
the agent is never called into, so a stray keeps only where and by whom (no text, no files):
the surface still has the words, and gives them when the stray is adopted (docs/design.md).

A thread's records form its *line*: a record is answered only when no earlier record of the
thread still waits to be answered (``blocker``), so a thread's messages are answered in the
order they arrived, whichever replicas received them and whichever died in between.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Table,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.orm import aliased

from core.storage.batched import delete_in_batches
from core.storage.dialect import ago, db_now, insert_ignoring, update_returning
from core.storage.engine import Conn, Database
from core.storage.models import Delivery, Id
from core.storage.prepared import Prepared, constant_in, constant_not_in

DELIVERIES: Final = cast(Table, Delivery.__table__)
D: Final = DELIVERIES.c

ACTIVE: Final = ("received", "started", "waiting")
PASSIVE: Final = ("offered", "stale")
FINISHED: Final = ("done", "discarded", "expired", "failed", "ignored", "stray")
# Why a record waits. ``thread``: behind an earlier message of its thread; ``queue``: on a busy
# session, to be sent in order when it frees; ``ask``: on a busy session, to be offered.
IN_LINE: Final = ("thread", "queue")
# A record taken over this many times has probably killed every replica that tried it.
MAX_TAKEOVERS: Final = 3
FINISHED_TTL_SECONDS: Final = 86400.0
# How long an offer (``offered``, ``stale``) waits for its Send/Discard click: a day, after which
# the record (the person's words with it) is swept; a late click finds the offer gone. A person
# who has not decided in a day has moved on, and a record nobody owns would otherwise be kept
# forever (surviving its session's deletion, and ageing the oldest-record gauge without end).
OFFER_TTL_SECONDS: Final = 86400.0
# How long a stray waits for its thread's first message: beyond Slack's last retry (about five
# minutes after the first try), and no longer, as it may be chatter the agent was never in.
STRAY_SECONDS: Final = 600.0


@dataclass(frozen=True)
class DeliveryRecord:
    id: int
    event_key: str
    thread_key: str
    session_id: int | None
    author: str
    message_id: str
    text: str
    context: dict[str, Any]
    state: str
    wait_reason: str | None
    owner: str | None
    takeovers: int
    created_at: datetime
    reply_ref: str | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


@dataclass(frozen=True)
class StateCount:
    state: str
    wait_reason: str | None
    count: int
    oldest_age_seconds: float


def _record(row: Any) -> DeliveryRecord:
    return DeliveryRecord(
        id=int(row.id),
        event_key=row.event_key,
        thread_key=row.thread_key,
        session_id=None if row.session_id is None else int(row.session_id),
        author=row.author,
        message_id=row.message_id,
        text=row.text,
        context=dict(row.context),
        state=row.state,
        wait_reason=row.wait_reason,
        owner=row.owner,
        takeovers=int(row.takeovers),
        created_at=row.created_at,
        reply_ref=row.reply_ref,
    )


def _received(values: dict[str, Any], record_id: int, created_at: datetime) -> DeliveryRecord:
    """The record just inserted, from what was inserted (RETURNING only what the database
    made: decoding every column of a burst of rows was most of the insert's time)."""
    return DeliveryRecord(
        id=record_id,
        event_key=values["event_key"],
        thread_key=values["thread_key"],
        session_id=None,
        author=values["author"],
        message_id=values["message_id"],
        text=values["text"],
        context=values["context"],
        state=values["state"],
        wait_reason=None,
        owner=values["owner"],
        takeovers=0,
        created_at=created_at,
    )


def _lapsed(staleness_seconds: float) -> ColumnElement[bool]:
    """Active and nobody's: released, or the owner stopped renewing its lease."""
    return and_(D.state.in_(ACTIVE), or_(D.lease_at.is_(None), D.lease_at < ago(staleness_seconds)))


# -- the statements of every message's path, built once with bind parameters ----------------------
# Building a statement per call cost more than SQLite takes to run it (docs/benchmarks.md, *A
# turn's own CPU*); these are built at import (or once per shape) and run with parameters
# (``core.storage.prepared``).

_SURFACE: Final = bindparam("surface", type_=D.surface.type)
_THREAD: Final = bindparam("thread_key", type_=D.thread_key.type)
_RECORD_ID: Final = bindparam("record_id", type_=Id)
_ME: Final = bindparam("me", type_=D.owner.type)  # this process's ``owner``
# An UPDATE's parameters never take a column's name: SQLAlchemy's ordinary way would read one as
# a further column to SET.

_RECORD_VALUES: Final[dict[str, Any]] = {
    **{
        c: bindparam(c, type_=D[c].type)
        for c in ("surface", "event_key", "thread_key", "author", "message_id", "text")
    },
    "context": bindparam("context", type_=D.context.type),
    "state": bindparam("state", type_=D.state.type),
    "owner": bindparam("owner", type_=D.owner.type),
    "lease_at": case((bindparam("owned", type_=Boolean()), db_now()), else_=null()),
}
# A received message: executed with one row, or with a burst's rows as one multi-row INSERT
# (SQLAlchemy's "insertmanyvalues"). SQLite before 3.35 has no RETURNING (``_insert_rows``).
_RECORD: Final = insert_ignoring(
    DELIVERIES, _RECORD_VALUES, ("surface", "event_key"), (D.id, D.event_key, D.created_at)
)
_RECORD_UNRETURNED: Final = insert_ignoring(DELIVERIES, _RECORD_VALUES, ("surface", "event_key"))

# A thread's strays that may be adopted: posted after its first recorded message, recently.
_FIRST_IN_THREAD: Final = (
    select(func.min(D.event_key))
    .where(
        D.surface == _SURFACE,
        D.thread_key == _THREAD,
        constant_not_in(D.state, ("ignored", "stray")),
    )
    .scalar_subquery()
)
_FIND_STRAYS: Final = (
    select(*D)
    .where(
        D.surface == _SURFACE,
        D.thread_key == _THREAD,
        D.state == "stray",
        D.created_at >= ago(STRAY_SECONDS),
        or_(_FIRST_IN_THREAD.is_(None), D.event_key > _FIRST_IN_THREAD),
    )
    .order_by(D.id)
)
_STRAYS: Final = Prepared(_FIND_STRAYS)

_BLOCKER: Final = Prepared(
    select(*D)
    .where(
        D.surface == _SURFACE,
        D.thread_key == _THREAD,
        D.id < _RECORD_ID,
        or_(
            constant_in(D.state, ("received", "started")),
            and_(D.state == "waiting", constant_in(D.wait_reason, IN_LINE)),
        ),
    )
    .order_by(D.id)
    .limit(1)
)

_SET_REPLY: Final = Prepared(
    update(DELIVERIES)
    .where(D.id == _RECORD_ID, D.owner == _ME)
    .values(reply_ref=bindparam("reply_ref", type_=D.reply_ref.type))
)

_BY_ID: Final = Prepared(select(*D).where(D.id == _RECORD_ID))


def _changed(statement: Any, *, returning: bool) -> Prepared:
    return Prepared(statement.returning(*D) if returning else statement)


@functools.cache
def _move(
    from_states: tuple[str, ...],
    to_state: str,
    keys: tuple[str, ...],
    *,
    waiting_now: bool,
    returning: bool,
) -> Prepared:
    """``Deliveries.move``'s statement for one shape of call (the states, the columns set):
    a few shapes in all, each built once. The columns' values are parameters ``v_<column>``."""
    values: dict[str, Any] = {key: bindparam(f"v_{key}", type_=D[key].type) for key in keys}
    values.update(state=to_state, updated_at=db_now())
    if waiting_now:
        values["waiting_since"] = db_now()
    if to_state not in ACTIVE:
        values.update(owner=None, lease_at=None)
    statement = (
        update(DELIVERIES)
        .where(D.id == _RECORD_ID, D.owner == _ME, constant_in(D.state, from_states))
        .values(values)
    )
    return _changed(statement, returning=returning)


@functools.cache
def _claim(from_states: tuple[str, ...], *, by_author: bool, returning: bool) -> Prepared:
    """``Deliveries.claim``'s statement, per shape (see ``_move``)."""
    condition = and_(D.id == _RECORD_ID, constant_in(D.state, from_states))
    if by_author:
        condition = and_(condition, D.author == bindparam("by_author", type_=D.author.type))
    statement = (
        update(DELIVERIES)
        .where(condition)
        .values(
            state="received", waiting_since=None, owner=_ME, lease_at=db_now(), updated_at=db_now()
        )
    )
    return _changed(statement, returning=returning)


async def _changed_record(
    conn: Conn, statement: Callable[[bool], Prepared], params: dict[str, Any]
) -> DeliveryRecord | None:
    """Run an UPDATE of one record (by ``record_id``); the record as changed, or None. Where
    the database has no RETURNING (SQLite before 3.35), the record is read back in the same
    write transaction, which no other writer can interleave with; elsewhere it is one
    statement (so on PostgreSQL its callers run it autocommitted, ``Database.autocommit``)."""
    if conn.dialect.update_returning:
        rows = await statement(True).rows(conn, params)
    elif (await statement(False).run(conn, params)).rowcount:
        rows = await _BY_ID.rows(conn, {"record_id": params["record_id"]})
    else:
        rows = []
    return _record(rows[0]) if rows else None


class _GroupCommit:
    """Records of messages arriving together are written together: one multi-row INSERT (one
    commit, one WAL flush) for every record that waited while the previous one was written.

    Every acknowledgement waits for its record's commit, so under a burst this is what keeps
    the acknowledgements fast: N messages cost about one commit, not N queued on the pool.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self._waiting: list[tuple[dict[str, Any], asyncio.Future[DeliveryRecord | None]]] = []
        self._writer: asyncio.Task[None] | None = None

    @property
    def _returning(self) -> bool:
        return bool(self.db.sync_engine.dialect.insert_returning)

    async def _insert_rows(
        self, conn: Conn, rows: list[dict[str, Any]]
    ) -> dict[str, tuple[int, datetime]]:
        """Insert the rows not recorded yet; id and creation time of those inserted, by key.

        A SQLite older than 3.35: the rows are inserted without RETURNING, then read back by
        the ids above the largest one before the insert (the write lock keeps other writers out
        meanwhile). One row (a message on its own, the usual case) is prepared; a burst's rows
        are one multi-row INSERT, compiled once too (its statement is built at import)."""
        found: Any
        if self._returning:
            insert_ = _RECORD[conn.dialect.name]
            if len(rows) == 1:
                row = (await insert_.run(conn, rows[0])).row
                found = [] if row is None else [row]
            else:
                found = await conn.execute(insert_.statement, rows)
        else:
            before = await conn.scalar(select(func.coalesce(func.max(D.id), 0)))
            await conn.execute(_RECORD_UNRETURNED[conn.dialect.name].statement, rows)
            found = await conn.execute(
                select(D.id, D.event_key, D.created_at).where(
                    D.id > before,
                    D.event_key.in_([r["event_key"] for r in rows]),
                )
            )
        return {key: (int(record_id), created_at) for record_id, key, created_at in found}

    async def add(self, values: dict[str, Any]) -> DeliveryRecord | None:
        future: asyncio.Future[DeliveryRecord | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((values, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return await asyncio.shield(future)

    async def settle(self) -> None:
        """The write under way, if any, cancelled and ended: called when nobody waits for it
        any more (the requests that did were cancelled at a stop), before the database is
        disposed of. A cancelled write is a message not acknowledged: its sender sends it
        again, and a row that committed anyway is taken over like a stopped replica's."""
        writer = self._writer
        if writer is not None and not writer.done():
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _write(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            first: dict[str, dict[str, Any]] = {}
            for values, _ in batch:
                first.setdefault(values["event_key"], values)  # a duplicate in the same batch
            try:
                # Urgent: acknowledgements wait for this commit, turns' writes can wait. One
                # row (the usual case) is one statement, so on PostgreSQL it needs no BEGIN
                # and COMMIT round trips; a burst's rows may be several (insertmanyvalues
                # batches), and commit together.
                rows = list(first.values())
                opened = self.db.autocommit if len(rows) == 1 else self.db.write
                async with opened(urgent=True) as conn:
                    written = await self._insert_rows(conn, rows)
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for values, future in batch:
                if future.done():
                    continue
                key = values["event_key"]
                # Only the first of duplicates gets the record; the others are duplicates.
                found = written.pop(key, None) if first.get(key) is values else None
                future.set_result(None if found is None else _received(values, *found))


class Deliveries:
    """One process's view of the delivery records of one surface; ``owner`` names the process."""

    def __init__(
        self,
        db: Database,
        surface: str,
        *,
        staleness_seconds: float = 60.0,
        owner: str | None = None,
    ) -> None:
        self.db = db
        self.surface = surface
        self.staleness_seconds = float(staleness_seconds)
        # Who this process is to the records' leases: new unless given (an intake on an engine
        # of its own records as its replica's worker, which renews and moves what it records).
        self.owner = owner or uuid.uuid4().hex
        self._intake = _GroupCommit(db)

    def _mine(self, record_id: int) -> ColumnElement[bool]:
        return and_(D.id == record_id, D.owner == self.owner)

    async def record(
        self,
        *,
        event_key: str,
        thread_key: str,
        author: str,
        message_id: str,
        text: str,
        context: dict[str, Any],
        owned: bool = True,
        stray: bool = False,
    ) -> DeliveryRecord | None:
        """Record a received message; None if it was recorded before (a retry, a duplicate).

        ``owned=False`` records it for another replica to take at once (a stopping process
        that still got a message must not drop it, and must not start it either).
        ``stray``: a message of a thread not known yet, kept for ``adopt_strays`` without its
        ``text`` (the surface gives it when the stray is adopted).
        """
        owned = owned and not stray
        return await self._intake.add(
            {
                "surface": self.surface,
                "event_key": event_key,
                "thread_key": thread_key,
                "author": author,
                "message_id": message_id,
                "text": "" if stray else text,
                "context": context,
                "owner": self.owner if owned else None,
                "owned": owned,
                "state": "stray" if stray else "received",
            }
        )

    async def settle(self) -> None:
        """No record being written once this returns (``_GroupCommit.settle``): for a stop,
        after the requests that waited for it ended."""
        await self._intake.settle()

    async def strays(self, thread_key: str) -> list[DeliveryRecord]:
        """The strays of a thread that is known now and may be adopted (``adopt_strays``),
        oldest first; none in the usual case, read without a write.

        Only strays posted after the thread's first recorded message: what people wrote in a
        thread before they called the agent into it is context (``bot.context``), not a
        message to answer. (Slack ``ts`` values of one channel order as strings.)"""
        rows = await _STRAYS.fetch(self.db, {"surface": self.surface, "thread_key": thread_key})
        return [_record(row) for row in rows]

    async def adopt_strays(
        self, thread_key: str, words: dict[str, tuple[str, dict[str, Any]]], asked: list[str]
    ) -> list[DeliveryRecord]:
        """The strays ``asked`` about (by event key) recorded again as received records of
        this process, with the text and context the surface gave for each in ``words`` (after
        every record already in the thread's line, so they are answered after its first
        message), oldest first; a stray ``words`` has nothing for (its message was deleted)
        is dropped. Each stray is adopted by one caller."""
        if not asked:
            return []
        async with self.db.write() as conn:
            # Locked (PostgreSQL) or under the write lock (SQLite): one adopter per stray.
            found = _FIND_STRAYS.where(D.event_key.in_(asked))
            if self.db.dialect == "postgresql":
                found = found.with_for_update(skip_locked=True)
            params = {"surface": self.surface, "thread_key": thread_key}
            rows = list(await conn.execute(found, params))
            if not rows:
                return []
            await conn.execute(delete(DELIVERIES).where(D.id.in_([row.id for row in rows])))
            kept = [row for row in rows if row.event_key in words]
            if not kept:
                return []
            await conn.execute(
                insert(DELIVERIES),
                [
                    {
                        "surface": row.surface,
                        "event_key": row.event_key,
                        "thread_key": row.thread_key,
                        "author": row.author,
                        "message_id": row.message_id,
                        "text": words[row.event_key][0],
                        "context": words[row.event_key][1],
                        "state": "received",
                        "owner": self.owner,
                        "created_at": row.created_at,
                    }
                    for row in kept
                ],
            )
            keys = [row.event_key for row in kept]
            adopted = and_(D.surface == self.surface, D.event_key.in_(keys))
            await conn.execute(update(DELIVERIES).where(adopted).values(lease_at=db_now()))
            again = await conn.execute(select(*D).where(adopted).order_by(D.id))
            return [_record(row) for row in again]

    async def get(self, record_id: int) -> DeliveryRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(select(DELIVERIES).where(D.id == record_id))).first()
        return None if row is None else _record(row)

    async def thread_known(self, thread_key: str) -> bool:
        """Some message of this thread was recorded (its session may not exist yet)."""
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(
                    exists().where(
                        D.surface == self.surface,
                        D.thread_key == thread_key,
                        D.state.not_in(("ignored", "stray")),
                    )
                )
            )
        return bool(found)

    async def blocker(self, record: DeliveryRecord) -> DeliveryRecord | None:
        """The earliest record of the same thread that must be answered before this one."""
        params = {"surface": self.surface, "thread_key": record.thread_key, "record_id": record.id}
        rows = await _BLOCKER.fetch(self.db, params)
        return _record(rows[0]) if rows else None

    async def unblocked(self, record_ids: list[int]) -> set[int]:
        """Which of these records have nothing left before them in their thread's line (one
        query for all the records a replica has waiting)."""
        if not record_ids:
            return set()
        earlier = aliased(DELIVERIES)
        blocked = exists().where(
            earlier.c.surface == D.surface,
            earlier.c.thread_key == D.thread_key,
            earlier.c.id < D.id,
            or_(
                earlier.c.state.in_(("received", "started")),
                and_(earlier.c.state == "waiting", earlier.c.wait_reason.in_(IN_LINE)),
            ),
        )
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(D.id).where(D.id.in_(bindparam("ids", expanding=True)), ~blocked),
                {"ids": record_ids},
            )
            return {int(r) for r in rows.scalars()}

    async def expire_overdue_many(self, record_ids: list[int], timeout_seconds: float) -> set[int]:
        """``expire_overdue`` for many records in one statement; the ids that expired."""
        if not record_ids:
            return set()
        async with self.db.write() as conn:
            rows = await update_returning(
                conn,
                DELIVERIES,
                and_(
                    D.id.in_(bindparam("ids", expanding=True)),
                    D.owner == self.owner,
                    D.state == "waiting",
                    D.wait_reason.in_(("ask", "queue")),
                    D.waiting_since < ago(timeout_seconds),
                ),
                {"state": "expired", "owner": None, "lease_at": None, "updated_at": db_now()},
                [D.id],
                {"ids": record_ids},
            )
            return {int(r.id) for r in rows}

    async def move(
        self, record_id: int, from_states: tuple[str, ...], to_state: str, **values: Any
    ) -> DeliveryRecord | None:
        """Change the state of a record this process owns; None if it is not (or no longer)
        ours or not in ``from_states``. Leaving the active states gives the record up.
        ``values``: other columns to set, as plain values."""
        return await self._move(record_id, from_states, to_state, values, waiting_now=False)

    async def moved(
        self, record_id: int, from_states: tuple[str, ...], to_state: str, **values: Any
    ) -> bool:
        """``move`` for a caller that needs only whether the record moved: the same statement,
        fenced the same way, without reading the record back (``RETURNING`` every column and
        making a ``DeliveryRecord`` of it was about 22 µs of CPU of a move's 75 on SQLite,
        twice a turn: docs/benchmarks.md, thirteenth pass)."""
        params = {f"v_{key}": value for key, value in values.items()}
        params.update(record_id=record_id, me=self.owner)
        statement = _move(
            tuple(from_states), to_state, tuple(sorted(values)), waiting_now=False, returning=False
        )
        async with self.db.autocommit() as conn:
            return (await statement.run(conn, params)).rowcount == 1

    async def _move(
        self,
        record_id: int,
        from_states: tuple[str, ...],
        to_state: str,
        values: dict[str, Any],
        *,
        waiting_now: bool,
    ) -> DeliveryRecord | None:
        keys = tuple(sorted(values))
        params = {f"v_{key}": value for key, value in values.items()}
        params.update(record_id=record_id, me=self.owner)

        def statement(returning: bool) -> Prepared:
            return _move(
                tuple(from_states), to_state, keys, waiting_now=waiting_now, returning=returning
            )

        async with self.db.autocommit() as conn:
            return await _changed_record(conn, statement, params)

    async def wait(
        self,
        record_id: int,
        from_states: tuple[str, ...],
        reason: str,
        *,
        session_id: int | None = None,
    ) -> DeliveryRecord | None:
        """An owned record starts waiting (``reason``: see ``IN_LINE``); the busy timeout
        counts from now, on the database clock. ``session_id``: the session it waits on."""
        values: dict[str, Any] = {"wait_reason": reason}
        if session_id is not None:
            values["session_id"] = session_id
        return await self._move(record_id, from_states, "waiting", values, waiting_now=True)

    async def set_reply(self, record_id: int, reply_ref: str) -> None:
        """Remember where the answer is being shown (fenced on the owner, like every move)."""
        params = {"record_id": record_id, "me": self.owner, "reply_ref": reply_ref}
        async with self.db.autocommit() as conn:
            await _SET_REPLY.run(conn, params)

    async def claim(
        self, record_id: int, from_states: tuple[str, ...], *, author: str | None = None
    ) -> DeliveryRecord | None:
        """A passive record becomes ours and ``received`` again (a Send click on any replica).
        ``wait_reason`` is kept: a message that waited on a busy session was sent knowingly."""
        params = {"record_id": record_id, "me": self.owner, "by_author": author}

        def statement(returning: bool) -> Prepared:
            return _claim(tuple(from_states), by_author=author is not None, returning=returning)

        async with self.db.autocommit() as conn:
            return await _changed_record(conn, statement, params)

    async def discard(self, record_id: int, *, author: str) -> DeliveryRecord | None:
        """The author drops a message that is waiting or offered (whoever owns it)."""
        async with self.db.write() as conn:
            rows = await update_returning(
                conn,
                DELIVERIES,
                and_(D.id == record_id, D.author == author, D.state.in_(("waiting", *PASSIVE))),
                {"state": "discarded", "owner": None, "lease_at": None, "updated_at": db_now()},
                list(DELIVERIES.c),
            )
        return _record(rows[0]) if rows else None

    async def expire_overdue(self, record_id: int, timeout_seconds: float) -> DeliveryRecord | None:
        """Give up on a record that has waited on a busy session for longer than the timeout
        (measured on the database clock from when it started waiting, across take-overs)."""
        async with self.db.write() as conn:
            rows = await update_returning(
                conn,
                DELIVERIES,
                and_(
                    self._mine(record_id),
                    D.state == "waiting",
                    D.wait_reason.in_(("ask", "queue")),
                    D.waiting_since < ago(timeout_seconds),
                ),
                {"state": "expired", "owner": None, "lease_at": None, "updated_at": db_now()},
                list(DELIVERIES.c),
            )
        return _record(rows[0]) if rows else None

    async def refresh(self, record_ids: list[int]) -> set[int]:
        """Renew the leases of these records; returns the ids that are still ours."""
        if not record_ids:
            return set()
        async with self.db.write() as conn:
            rows = await update_returning(
                conn,
                DELIVERIES,
                and_(
                    D.owner == self.owner,
                    D.id.in_(bindparam("ids", expanding=True)),
                    D.state.in_(ACTIVE),
                ),
                {"lease_at": db_now()},
                [D.id],
                {"ids": record_ids},
            )
            return {int(r.id) for r in rows}

    async def release(self, record_ids: list[int]) -> int:
        """Give these records up so another replica takes them at once (a clean stop)."""
        if not record_ids:
            return 0
        async with self.db.write() as conn:
            result = await conn.execute(
                update(DELIVERIES)
                .where(
                    D.owner == self.owner,
                    D.id.in_(bindparam("ids", expanding=True)),
                    D.state.in_(ACTIVE),
                )
                .values(owner=None, lease_at=None, updated_at=db_now()),
                {"ids": record_ids},
            )
            return int(result.rowcount)

    async def take_over(self, limit: int) -> list[DeliveryRecord]:
        """Take up to ``limit`` active records whose lease lapsed, oldest first."""
        lapsed = _lapsed(self.staleness_seconds)
        candidates = (
            select(D.id)
            .where(D.surface == self.surface, lapsed)
            .order_by(D.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .scalar_subquery()
        )
        async with self.db.write() as conn:
            rows = await update_returning(
                conn,
                DELIVERIES,
                and_(D.id.in_(candidates), lapsed),
                {
                    "owner": self.owner,
                    "lease_at": db_now(),
                    # A released record (a clean stop) was not abandoned: it does not count.
                    "takeovers": D.takeovers + case((D.owner.is_(None), 0), else_=1),
                    "updated_at": db_now(),
                },
                list(DELIVERIES.c),
            )
            taken = [_record(r) for r in rows]
        return sorted(taken, key=lambda r: r.id)

    async def count_owned_by(self, owner: str) -> int:
        """Active records a replica (by its ``owner`` id) still holds: after it died, how many
        are left to take over."""
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(func.count()).where(D.owner == owner, D.state.in_(ACTIVE))
            )
        return int(found or 0)

    async def counts(self) -> list[StateCount]:
        """Records that are not finished, by state and reason, with the age of the oldest."""
        async with self.db.read() as conn:
            now = await conn.scalar(select(db_now()))
            rows = await conn.execute(
                select(
                    D.state,
                    D.wait_reason,
                    func.count().label("n"),
                    func.min(D.created_at).label("oldest"),
                )
                .where(D.surface == self.surface, D.state.in_((*ACTIVE, *PASSIVE)))
                .group_by(D.state, D.wait_reason)
            )
            found: list[Any] = list(rows)
        return [
            StateCount(
                state=str(row.state),
                wait_reason=row.wait_reason,
                count=int(row.n),
                oldest_age_seconds=max(0.0, (now - row.oldest).total_seconds())
                if row.oldest
                else 0.0,
            )
            for row in found
        ]


async def sweep_finished_deliveries(db: Database, batch_size: int) -> int:
    """Sweeper pass: finished records older than a day (Slack retries within minutes, and a
    finished record only answers "already taken" to a late retry), strays nobody adopted,
    offers nobody answered within ``OFFER_TTL_SECONDS``."""
    finished = or_(
        and_(D.state.in_(FINISHED), D.updated_at < ago(FINISHED_TTL_SECONDS)),
        and_(D.state == "stray", D.created_at < ago(STRAY_SECONDS)),
        and_(D.state.in_(PASSIVE), D.updated_at < ago(OFFER_TTL_SECONDS)),
    )
    return await delete_in_batches(
        db,
        DELIVERIES,
        select(D.id).where(finished).order_by(D.id),
        finished,
        batch_size,
        name="deliveries",
    )
