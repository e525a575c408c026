"""What a chat surface remembers beside the sessions (threads and message refs), keyed
by a surface name so nothing here knows which chat it is. Received messages, waiting ones
included, are delivery records (``core.storage.deliveries``).

What the statements guarantee:

- ``bind_thread``: idempotent under concurrency, the first binding wins.
- ``add_ref``: idempotent; a Slack message stands for one transcript message.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final, cast

from sqlalchemy import Table, bindparam, select, update

from core.storage.batched import delete_in_batches
from core.storage.deliveries import sweep_finished_deliveries
from core.storage.dialect import ago, db_now, insert_ignoring
from core.storage.engine import Database
from core.storage.models import (
    Id,
    SurfaceMessageRef,
    SurfaceStash,
    SurfaceThread,
    SurfaceViewing,
)
from core.storage.prepared import Prepared

THREADS: Final = cast(Table, SurfaceThread.__table__)
REFS: Final = cast(Table, SurfaceMessageRef.__table__)
VIEWING: Final = cast(Table, SurfaceViewing.__table__)
STASH: Final = cast(Table, SurfaceStash.__table__)
STASH_TTL_SECONDS: Final = 86400.0

# -- every turn's statements, built once with bind parameters (``core.storage.prepared``) ----------

_SURFACE: Final = bindparam("surface", type_=THREADS.c.surface.type)
_THREAD: Final = bindparam("thread_key", type_=THREADS.c.thread_key.type)
_SESSION: Final = bindparam("session_id", type_=Id)
_THREAD_COLUMNS: Final = (
    THREADS.c.thread_key,
    THREADS.c.session_id,
    THREADS.c.last_shown_message_id,
)
_GET_THREAD: Final = Prepared(
    select(*_THREAD_COLUMNS).where(THREADS.c.surface == _SURFACE, THREADS.c.thread_key == _THREAD)
)
_NEW_THREAD: Final[dict[str, Any]] = {
    "surface": _SURFACE,
    "thread_key": _THREAD,
    "session_id": _SESSION,
    "last_shown_message_id": bindparam("shown", type_=THREADS.c.last_shown_message_id.type),
}
# By whether the binding is returned (RETURNING, where the database has it, so a new binding is
# not read back), then dialect.
_BIND_THREAD: Final = {
    returned: insert_ignoring(
        THREADS,
        _NEW_THREAD,
        ("surface", "thread_key"),
        returning=_THREAD_COLUMNS if returned else (),
    )
    for returned in (False, True)
}
# An UPDATE's parameters never take a column's name: SQLAlchemy's ordinary way would read one as
# a further column to SET.
_SET_SHOWN: Final = Prepared(
    update(THREADS)
    .where(
        THREADS.c.surface == bindparam("of_surface", type_=THREADS.c.surface.type),
        THREADS.c.session_id == bindparam("of_session", type_=Id),
    )
    .values(
        last_shown_message_id=bindparam("shown", type_=THREADS.c.last_shown_message_id.type),
        updated_at=db_now(),
    )
)
_ADD_REF: Final = insert_ignoring(
    REFS,
    {
        "surface": _SURFACE,
        "ref_key": bindparam("ref_key", type_=REFS.c.ref_key.type),
        "session_id": _SESSION,
        "message_id": bindparam("message_id", type_=REFS.c.message_id.type),
        "kind": bindparam("kind", type_=REFS.c.kind.type),
    },
    ("surface", "ref_key"),
)


@dataclass(frozen=True)
class ThreadInfo:
    thread_key: str
    session_id: int
    last_shown_message_id: str | None


@dataclass(frozen=True)
class MessageRef:
    ref_key: str
    session_id: int
    message_id: str
    kind: str


class SurfaceState:
    """The surface tables of one surface (``surface`` names it, e.g. the chat product)."""

    def __init__(self, db: Database, surface: str) -> None:
        self.db = db
        self.surface = surface

    # -- threads --------------------------------------------------------------------------------

    async def bind_thread(
        self, thread_key: str, session_id: int, last_shown_message_id: str | None = None
    ) -> ThreadInfo:
        """The thread's binding; made if there is none (an existing one is kept as it is).

        Read first: every turn of a thread binds it, and all but the first find it bound.
        """
        found = await self.get_thread(thread_key)
        if found is not None:
            return found
        params = {
            "surface": self.surface,
            "thread_key": thread_key,
            "session_id": session_id,
            "shown": last_shown_message_id,
        }
        async with self.db.autocommit() as conn:
            returned = bool(conn.dialect.insert_returning)
            row = (await _BIND_THREAD[returned][conn.dialect.name].run(conn, params)).row
        if row is not None:
            return ThreadInfo(row[0], int(row[1]), row[2])
        found = await self.get_thread(thread_key)  # bound meanwhile by another, or not returned
        assert found is not None
        return found

    async def get_thread(self, thread_key: str) -> ThreadInfo | None:
        rows = await _GET_THREAD.fetch(self.db, {"surface": self.surface, "thread_key": thread_key})
        if not rows:
            return None
        key, session_id, shown = rows[0]
        return ThreadInfo(key, int(session_id), shown)

    async def find_thread_ending(self, suffix: str) -> ThreadInfo | None:
        """The thread whose key ends with ``suffix`` (a permalink names a channel and a ts but
        not the workspace). A scan of this surface's threads: for the terminal's start-up,
        never on a hot path."""
        row = await self._first_ending(THREADS, THREADS.c.thread_key, suffix)
        if row is None:
            return None
        return ThreadInfo(row.thread_key, int(row.session_id), row.last_shown_message_id)

    async def thread_of_session(self, session_id: int) -> ThreadInfo | None:
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    select(THREADS)
                    .where(THREADS.c.surface == self.surface, THREADS.c.session_id == session_id)
                    .order_by(THREADS.c.id)
                    .limit(1)
                )
            ).first()
        if row is None:
            return None
        return ThreadInfo(row.thread_key, int(row.session_id), row.last_shown_message_id)

    async def set_shown(self, session_id: int, message_id: str | None) -> None:
        """Record the tail the surface's thread(s) of the session now show."""
        params = {"of_surface": self.surface, "of_session": session_id, "shown": message_id}
        async with self.db.autocommit() as conn:
            await _SET_SHOWN.run(conn, params)

    # -- state between a posted message and a click on it -----------------------------------------

    async def stash(self, value: dict[str, Any]) -> str:
        key = str(uuid.uuid4())
        async with self.db.write() as conn:
            await conn.execute(STASH.insert().values(id=key, surface=self.surface, value=value))
        return key

    async def unstash(self, key: str) -> dict[str, Any] | None:
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(STASH.c.value).where(STASH.c.id == key, STASH.c.surface == self.surface)
            )
        return None if found is None else dict(found)

    # -- what a person is looking at ------------------------------------------------------------

    async def set_viewing(self, person: str, context: dict[str, Any]) -> None:
        async with self.db.write() as conn:
            stmt = self.db.upsert(VIEWING).values(
                surface=self.surface, person=person, context=context, updated_at=db_now()
            )
            await conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["surface", "person"],
                    set_={"context": stmt.excluded.context, "updated_at": db_now()},
                )
            )

    async def viewing(self, person: str) -> dict[str, Any] | None:
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(VIEWING.c.context).where(
                    VIEWING.c.surface == self.surface, VIEWING.c.person == person
                )
            )
        return None if found is None else dict(found)

    # -- message references ---------------------------------------------------------------------

    async def add_ref(self, ref_key: str, session_id: int, message_id: str, kind: str) -> None:
        params = {
            "surface": self.surface,
            "ref_key": ref_key,
            "session_id": session_id,
            "message_id": message_id,
            "kind": kind,
        }
        async with self.db.autocommit() as conn:
            await _ADD_REF[conn.dialect.name].run(conn, params)

    async def find_ref(self, ref_key: str) -> MessageRef | None:
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    select(REFS).where(REFS.c.surface == self.surface, REFS.c.ref_key == ref_key)
                )
            ).first()
        return (
            None
            if row is None
            else MessageRef(row.ref_key, row.session_id, row.message_id, row.kind)
        )

    async def find_ref_ending(self, suffix: str) -> MessageRef | None:
        """The message ref whose key ends with ``suffix`` (see ``find_thread_ending``)."""
        row = await self._first_ending(REFS, REFS.c.ref_key, suffix)
        return (
            None
            if row is None
            else MessageRef(row.ref_key, row.session_id, row.message_id, row.kind)
        )

    async def _first_ending(self, table: Table, key: Any, suffix: str) -> Any:
        """The oldest row of ``table`` on this surface whose ``key`` ends with ``suffix``."""
        async with self.db.read() as conn:
            return (
                await conn.execute(
                    select(table)
                    .where(table.c.surface == self.surface, key.endswith(suffix, autoescape=True))
                    .order_by(table.c.id)
                    .limit(1)
                )
            ).first()

    async def refs_for(self, message_ids: list[str]) -> list[MessageRef]:
        if not message_ids:
            return []
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(REFS)
                .where(REFS.c.surface == self.surface, REFS.c.message_id.in_(message_ids))
                .order_by(REFS.c.id)
            )
            return [MessageRef(r.ref_key, r.session_id, r.message_id, r.kind) for r in rows]


async def sweep_stash(db: Database, batch_size: int) -> int:
    """Sweeper pass: stashed click state older than a day (nobody clicks that late)."""
    old = STASH.c.created_at < ago(STASH_TTL_SECONDS)
    return await delete_in_batches(
        db, STASH, select(STASH.c.id).where(old).order_by(STASH.c.id), old, batch_size, name="stash"
    )


# The sweeper passes over surface tables (``serve``'s sweeper thread and ``sweep --once``).
SURFACE_SWEEPS: Final = (
    ("deliveries", sweep_finished_deliveries),
    ("stash", sweep_stash),
)
