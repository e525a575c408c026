"""The session store: sessions, users and the turn lock; transcript operations mix in.

Each public method is one transaction. What the turn protocol's statements guarantee:

- ``start_turn``: the claim is one conditional UPDATE (free or stale lock -> ours, with a new
  fencing token, on the database clock); in the same transaction the tail is compared with the
  client's ``last_message_id`` and the user message is inserted. The claim comes first, so once
  it holds no other writer can move the tail; a refusal (busy, stale) rolls everything back.
- ``heartbeat``, ``append``, ``finish``, ``release``: conditional on the fencing token, so a
  turn whose lock was taken over can neither extend, clear nor write into the new owner's turn.
- ``delete_session``: refused while a turn is active.

Orchestration (a turn with its heartbeat task, compaction) lives above this module and never
builds SQL; the statements live here, in ``core.transcript``, ``core.queries`` and the sweeper.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import Boolean, delete, func, literal, select, type_coerce, update
from sqlalchemy.ext.asyncio import AsyncConnection

from core import queries as q
from core.db import Database, db_now, hence
from core.errors import (
    AgentSessionBusy,
    AgentSessionLockLost,
    AgentSessionNotFound,
    AgentSessionStale,
)
from core.messages import Message, message_text, shorten
from core.models import validate_message
from core.records import Actor, ModelChoice, SessionInfo, StoredMessage, TurnLease
from core.transcript import TranscriptOperations

SESSIONS: Final = q.SESSIONS
USERS: Final = q.USERS


class _Unset:
    """Marker for "do not check the tail" (compaction claims the lock without a stale guard)."""


ANY_TAIL: Final = _Unset()


class SessionStore(TranscriptOperations):
    """Async API every surface calls (Slack, terminal client, command line)."""

    def __init__(
        self,
        db: Database,
        *,
        staleness_seconds: float = 60.0,
        temporary_ttl_hours: float = 24.0,
    ) -> None:
        self.db = db
        self.staleness_seconds = float(staleness_seconds)
        self.temporary_ttl_hours = float(temporary_ttl_hours)

    # -- users and sessions -------------------------------------------------------------------

    async def get_or_create_user(self, external_id: str, display_name: str | None = None) -> int:
        """Idempotent under concurrency: replicas meeting a new user at once agree on one row."""
        async with self.db.write() as conn:
            await conn.execute(
                self.db.upsert(USERS)
                .values(external_id=external_id, display_name=display_name)
                .on_conflict_do_nothing(index_elements=["external_id"])
            )
            user_id = await conn.scalar(
                select(USERS.c.id).where(USERS.c.external_id == external_id)
            )
        assert user_id is not None
        return int(user_id)

    async def get_or_create_session(
        self,
        project_name: str,
        project_session_id: str,
        *,
        user_id: int | None,
        title: str | None = None,
        temporary: bool = False,
    ) -> tuple[SessionInfo, bool]:
        """The session for ``(project_name, project_session_id)``, and whether it was created.

        The first caller owns it; concurrent callers (replicas, retries) get the same row.
        """
        found = await self.find_session(project_name, project_session_id)
        if found is not None:
            return found, False
        values: dict[str, Any] = {
            "project_name": project_name,
            "project_session_id": project_session_id,
            "user_id": user_id,
            "title": shorten(title) if title else None,
        }
        async with self.db.write() as conn:
            stmt = self.db.upsert(SESSIONS).values(**values)
            if temporary:
                stmt = stmt.values(expires_at=hence(self.temporary_ttl_hours * 3600))
            result = await conn.execute(
                stmt.on_conflict_do_nothing(
                    index_elements=["project_name", "project_session_id"]
                ).returning(SESSIONS.c.id)
            )
            created = result.first() is not None
        session = await self.find_session(project_name, project_session_id)
        if session is None:  # deleted between the two statements: treat as not found
            raise AgentSessionNotFound(f"session {project_name}/{project_session_id} vanished")
        return session, created

    async def find_session(self, project_name: str, project_session_id: str) -> SessionInfo | None:
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    q.session_select(self.staleness_seconds).where(
                        SESSIONS.c.project_name == project_name,
                        SESSIONS.c.project_session_id == project_session_id,
                    )
                )
            ).first()
        return None if row is None else q.session_info(row)

    async def get_session(self, session_id: int) -> SessionInfo:
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    q.session_select(self.staleness_seconds).where(SESSIONS.c.id == session_id)
                )
            ).first()
        if row is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        return q.session_info(row)

    async def list_sessions(
        self, *, user_id: int | None = None, project_name: str | None = None, limit: int = 50
    ) -> list[SessionInfo]:
        """Most recently updated first; the ``(user_id, updated_at)`` index serves user lists."""
        stmt = q.session_select(self.staleness_seconds)
        if user_id is not None:
            stmt = stmt.where(SESSIONS.c.user_id == user_id)
        if project_name is not None:
            stmt = stmt.where(SESSIONS.c.project_name == project_name)
        stmt = stmt.order_by(SESSIONS.c.updated_at.desc(), SESSIONS.c.id.desc()).limit(limit)
        async with self.db.read() as conn:
            return [q.session_info(row) for row in await conn.execute(stmt)]

    async def is_turn_active(self, session_id: int) -> bool:
        """The one "busy" predicate every surface polls (SPEC §6.9); reads, never writes."""
        async with self.db.read() as conn:
            active = await conn.scalar(
                select(type_coerce(q.turn_active(self.staleness_seconds), Boolean)).where(
                    SESSIONS.c.id == session_id
                )
            )
        if active is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        return bool(active)

    async def set_title(self, session_id: int, title: str, actor: Actor) -> None:
        async with self.db.write() as conn:
            await q.check_owner(conn, session_id, actor)
            await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id)
                .values(title=shorten(title), updated_at=db_now())
            )

    async def delete_session(self, session_id: int, actor: Actor) -> None:
        """Owner or admin only; refused while a turn is active, like a rewind."""
        async with self.db.write() as conn:
            await q.check_owner(conn, session_id, actor)
            result = await conn.execute(
                delete(SESSIONS).where(
                    SESSIONS.c.id == session_id, q.claimable(self.staleness_seconds)
                )
            )
            if result.rowcount == 0:
                raise AgentSessionBusy(f"session {session_id} has a turn in progress")

    # -- the turn lock ------------------------------------------------------------------------

    async def start_turn(
        self,
        session_id: int,
        *,
        user_message: Message | None,
        last_message_id: str | _Unset | None,
        model: ModelChoice | None = None,
    ) -> TurnLease:
        """Stale guard, claim, stamp and persist the user message, atomically (SPEC §6.1-4).

        ``last_message_id=ANY_TAIL`` skips the stale guard (compaction, which adds no user text).
        """
        token = uuid.uuid4().hex
        claim: dict[str, Any] = {
            "heartbeat_at": db_now(),
            "lock_token": token,
            "updated_at": db_now(),
        }
        if model is not None:  # stamp_session_model, inside the claim transaction
            claim.update(
                model_provider=model.provider,
                model_name=model.name,
                custom_provider_id=model.custom_provider_id,
                builtin_provider=model.builtin_provider,
            )
        if user_message is not None:
            validate_message(user_message)
            title = shorten(message_text(user_message)) or None
            claim["title"] = func.coalesce(SESSIONS.c.title, literal(title))
        async with self.db.write() as conn:
            claimed = await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id, q.claimable(self.staleness_seconds))
                .values(**claim)
            )
            if claimed.rowcount == 0:
                await q.raise_missing_or_busy(conn, session_id)
            tail = await q.tail(conn, session_id)
            if not isinstance(last_message_id, _Unset):
                actual = tail.message_id if tail else None
                if actual != last_message_id:
                    raise AgentSessionStale(
                        f"session {session_id} has moved on: its last message is {actual}, "
                        f"not {last_message_id}",
                        actual_last_message_id=actual,
                    )
            if user_message is not None:
                position = tail.position + 1 if tail else 0
                await q.insert_messages(conn, [q.message_row(session_id, position, user_message)])
                tail = StoredMessage(user_message["id"], position, user_message, False)
        return TurnLease(session_id=session_id, token=token, tail=tail)

    async def heartbeat(self, lease: TurnLease) -> None:
        async with self.db.write() as conn:
            await self._fence(conn, lease)

    async def append(
        self, lease: TurnLease, messages: Sequence[Message], *, compaction: bool = False
    ) -> list[StoredMessage]:
        """Append messages of the lease's turn (fenced), refreshing its heartbeat."""
        async with self.db.write() as conn:
            await self._fence(conn, lease)
            return await q.append_messages(
                conn, lease.session_id, [(m, compaction) for m in messages]
            )

    async def finish(
        self, lease: TurnLease, messages: Sequence[Message] = ()
    ) -> list[StoredMessage]:
        """Append the turn's last messages and release the lock in one transaction."""
        async with self.db.write() as conn:
            await self._fence(conn, lease, release=True)
            return await q.append_messages(conn, lease.session_id, [(m, False) for m in messages])

    async def release(self, lease: TurnLease) -> None:
        """Release the lock; ``AgentSessionLockLost`` if it is no longer ours (nothing changes)."""
        async with self.db.write() as conn:
            await self._fence(conn, lease, release=True)

    async def _fence(
        self, conn: AsyncConnection, lease: TurnLease, *, release: bool = False
    ) -> None:
        values: dict[str, Any] = {"updated_at": db_now()}
        if release:
            values.update(heartbeat_at=None, lock_token=None)
        else:
            values["heartbeat_at"] = db_now()
        result = await conn.execute(
            update(SESSIONS)
            .where(SESSIONS.c.id == lease.session_id, SESSIONS.c.lock_token == lease.token)
            .values(**values)
        )
        if result.rowcount == 0:
            raise AgentSessionLockLost(
                f"session {lease.session_id}: this turn's lock was taken over or released"
            )
