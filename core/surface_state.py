"""What a chat surface remembers beside the sessions (SPEC §5: threads, message refs, processed
deliveries, waiting drafts), keyed by a surface name so nothing here knows which chat it is.

What the statements guarantee:

- ``claim_event``: one ``INSERT ... ON CONFLICT DO NOTHING``; exactly one caller on any replica
  gets True for a key, so a retried or doubly delivered message is taken on once.
- ``take_draft``: one conditional UPDATE from the states given; exactly one caller (a button
  click on any replica, a poller) gets the draft.
- ``bind_thread``: idempotent under concurrency, the first binding wins.
- ``sweep_processed_events``: deletes records older than a day in batches (a sweeper pass).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final, cast

from sqlalchemy import Table, delete, literal, select, update

from core.db import Database, ago, db_now
from core.models import ProcessedEvent, SurfaceMessageRef, SurfaceThread, WaitingDraft

THREADS: Final = cast(Table, SurfaceThread.__table__)
REFS: Final = cast(Table, SurfaceMessageRef.__table__)
EVENTS: Final = cast(Table, ProcessedEvent.__table__)
DRAFTS: Final = cast(Table, WaitingDraft.__table__)

PROCESSED_EVENT_TTL_SECONDS: Final = 86400.0


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


@dataclass(frozen=True)
class Draft:
    id: str
    session_id: int
    author: str
    message_id: str
    text: str
    reason: str
    state: str
    context: dict[str, Any]


def _draft(row: Any) -> Draft:
    return Draft(
        id=row.id,
        session_id=int(row.session_id),
        author=row.author,
        message_id=row.message_id,
        text=row.text,
        reason=row.reason,
        state=row.state,
        context=dict(row.context),
    )


class SurfaceState:
    """The surface tables of one surface (``surface`` names it, e.g. the chat product)."""

    def __init__(self, db: Database, surface: str) -> None:
        self.db = db
        self.surface = surface

    # -- processed deliveries -------------------------------------------------------------------

    async def claim_event(self, event_key: str) -> bool:
        """True for exactly one caller per key, on any replica."""
        async with self.db.write() as conn:
            result = await conn.execute(
                self.db.upsert(EVENTS)
                .values(surface=self.surface, event_key=event_key)
                .on_conflict_do_nothing(index_elements=["surface", "event_key"])
                .returning(EVENTS.c.event_key)
            )
            return result.first() is not None

    async def event_claimed(self, event_key: str) -> bool:
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(EVENTS.c.event_key).where(
                    EVENTS.c.surface == self.surface, EVENTS.c.event_key == event_key
                )
            )
        return found is not None

    # -- threads --------------------------------------------------------------------------------

    async def bind_thread(
        self, thread_key: str, session_id: int, last_shown_message_id: str | None = None
    ) -> ThreadInfo:
        async with self.db.write() as conn:
            await conn.execute(
                self.db.upsert(THREADS)
                .values(
                    surface=self.surface,
                    thread_key=thread_key,
                    session_id=session_id,
                    last_shown_message_id=last_shown_message_id,
                )
                .on_conflict_do_nothing(index_elements=["surface", "thread_key"])
            )
        found = await self.get_thread(thread_key)
        assert found is not None
        return found

    async def get_thread(self, thread_key: str) -> ThreadInfo | None:
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    select(THREADS).where(
                        THREADS.c.surface == self.surface, THREADS.c.thread_key == thread_key
                    )
                )
            ).first()
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
        async with self.db.write() as conn:
            await conn.execute(
                update(THREADS)
                .where(THREADS.c.surface == self.surface, THREADS.c.session_id == session_id)
                .values(last_shown_message_id=message_id, updated_at=db_now())
            )

    # -- message references ---------------------------------------------------------------------

    async def add_ref(self, ref_key: str, session_id: int, message_id: str, kind: str) -> None:
        async with self.db.write() as conn:
            await conn.execute(
                self.db.upsert(REFS)
                .values(
                    surface=self.surface,
                    ref_key=ref_key,
                    session_id=session_id,
                    message_id=message_id,
                    kind=kind,
                )
                .on_conflict_do_nothing(index_elements=["surface", "ref_key"])
            )

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

    # -- waiting drafts -------------------------------------------------------------------------

    async def add_draft(
        self,
        *,
        session_id: int,
        author: str,
        message_id: str,
        text: str,
        reason: str,
        state: str,
        context: dict[str, Any],
    ) -> Draft:
        draft_id = str(uuid.uuid4())
        async with self.db.write() as conn:
            await conn.execute(
                DRAFTS.insert().values(
                    id=draft_id,
                    surface=self.surface,
                    session_id=session_id,
                    author=author,
                    message_id=message_id,
                    text=text,
                    reason=reason,
                    state=state,
                    context=context,
                )
            )
        found = await self.get_draft(draft_id)
        assert found is not None
        return found

    async def get_draft(self, draft_id: str) -> Draft | None:
        async with self.db.read() as conn:
            row = (await conn.execute(select(DRAFTS).where(DRAFTS.c.id == draft_id))).first()
        return None if row is None else _draft(row)

    async def take_draft(
        self, draft_id: str, from_states: tuple[str, ...], to_state: str
    ) -> Draft | None:
        """Move a draft from one of ``from_states`` to ``to_state``; None if someone else did."""
        async with self.db.write() as conn:
            result = await conn.execute(
                update(DRAFTS)
                .where(DRAFTS.c.id == draft_id, DRAFTS.c.state.in_(from_states))
                .values(state=to_state, updated_at=db_now())
            )
            if result.rowcount == 0:
                return None
            row = (await conn.execute(select(DRAFTS).where(DRAFTS.c.id == draft_id))).first()
        return None if row is None else _draft(row)

    async def first_waiting(self, session_id: int, states: tuple[str, ...]) -> str | None:
        """The oldest draft of the session in ``states`` (queue order)."""
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(DRAFTS.c.id)
                .where(DRAFTS.c.session_id == session_id, DRAFTS.c.state.in_(states))
                .order_by(DRAFTS.c.created_at, DRAFTS.c.id)
                .limit(1)
            )
        return None if found is None else str(found)


async def sweep_processed_events(db: Database, batch_size: int) -> int:
    """Sweeper pass: delivery records older than a day (Slack retries within minutes)."""
    deleted = 0
    while True:
        async with db.read() as conn:
            keys: list[Any] = list(
                await conn.execute(
                    select(EVENTS.c.surface, EVENTS.c.event_key)
                    .where(EVENTS.c.created_at < ago(PROCESSED_EVENT_TTL_SECONDS))
                    .limit(batch_size)
                )
            )
        if not keys:
            return deleted
        async with db.write() as conn:
            for row in keys:
                surface, key = row[0], row[1]
                result = await conn.execute(
                    delete(EVENTS).where(
                        EVENTS.c.surface == surface,
                        EVENTS.c.event_key == key,
                        EVENTS.c.created_at < ago(PROCESSED_EVENT_TTL_SECONDS),
                    )
                )
                deleted += result.rowcount
        if len(keys) < batch_size:
            return deleted


# The sweeper passes over surface tables (``serve``'s sweeper thread and ``sweep --once``).
SURFACE_SWEEPS: Final = (("processed_events", sweep_processed_events),)


async def database_answers(db: Database) -> bool:
    """Health check for load balancers: one trivial read."""
    try:
        async with db.read() as conn:
            return bool(await conn.scalar(select(literal(1))))
    except Exception:
        return False
