"""The session store: every statement of the turn protocol and the transcript, in one place.

Each public method is one transaction. What each one guarantees:

- ``start_turn``: the claim is one conditional UPDATE (free or stale lock -> ours, with a new
  fencing token, on the database clock); in the same transaction the tail is compared with the
  client's ``last_message_id`` and the user message is inserted. The claim comes first, so once
  it holds no other writer can move the tail; a refusal (busy, stale) rolls everything back.
- ``heartbeat``, ``append``, ``finish``, ``release``: conditional on the fencing token, so a
  turn whose lock was taken over can neither extend, clear nor write into the new owner's turn.
- ``truncate``, ``delete_session``: refused while a turn is active; they clear a stale lock's
  token, so the dead turn it belonged to cannot write afterwards either.
- ``branch``: reads only persisted messages, so it is allowed while the source is busy.
- ``history``: the latest checkpoint and what follows, in one indexed query.

Orchestration (a turn with its heartbeat task, compaction) lives above this module and never
builds SQL; only this module and the sweeper speak to the tables of the session store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Final

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Row,
    Select,
    and_,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    type_coerce,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from core.db import Database, ago, db_now, hence
from core.errors import (
    AgentSessionBusy,
    AgentSessionForbidden,
    AgentSessionLockLost,
    AgentSessionNotFound,
    AgentSessionStale,
    DuplicateMessage,
    MessageNotFound,
)
from core.messages import Message, message_text, shorten, with_new_id
from core.models import (
    AgentSession,
    AgentSessionMessage,
    AgentSessionSnapshot,
    User,
    validate_message,
)
from core.records import (
    Actor,
    BranchResult,
    ModelChoice,
    SessionInfo,
    StoredMessage,
    TruncateResult,
    TurnLease,
)

SESSIONS: Final = AgentSession.__table__
MESSAGES: Final = AgentSessionMessage.__table__
SNAPSHOTS: Final = AgentSessionSnapshot.__table__
USERS: Final = User.__table__


class _Unset:
    """Marker for "do not check the tail" (compaction claims the lock without a stale guard)."""


ANY_TAIL: Final = _Unset()

_MESSAGE_COLUMNS = (
    MESSAGES.c.message_id,
    MESSAGES.c.position,
    MESSAGES.c.message,
    MESSAGES.c.is_compaction_message,
)


def _stored(row: Row[Any]) -> StoredMessage:
    return StoredMessage(
        message_id=row.message_id,
        position=row.position,
        message=row.message,
        is_compaction_message=bool(row.is_compaction_message),
    )


def message_row(
    session_id: int, position: int, message: Message, *, compaction: bool = False
) -> dict[str, Any]:
    """The one way a message becomes a row: its id is checked and ``message_id`` derived."""
    return {
        "session_id": session_id,
        "position": position,
        "message": message,
        "message_id": validate_message(message),
        "is_compaction_message": compaction,
    }


def history_statement(session_id: int) -> Select[Any]:
    """The projection as one query whose cost follows the projected size, not the history.

    Both bounds are index seeks (the latest checkpoint and the tail), and the range between them
    is scanned on ``(session_id, position)``. The upper bound is redundant for correctness; it
    is there so PostgreSQL's planner sees a bounded range (it estimates an open-ended
    ``position >= $1`` at a third of the table and would scan the whole session).
    """

    def latest(*conditions: ColumnElement[bool]) -> Any:
        return (
            select(func.max(MESSAGES.c.position))
            .where(MESSAGES.c.session_id == session_id, *conditions)
            .scalar_subquery()
        )

    return (
        select(*_MESSAGE_COLUMNS)
        .where(
            MESSAGES.c.session_id == session_id,
            MESSAGES.c.position.between(
                func.coalesce(latest(MESSAGES.c.is_compaction_message.is_(True)), 0), latest()
            ),
        )
        .order_by(MESSAGES.c.position)
    )


class SessionStore:
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

    # -- predicates ---------------------------------------------------------------------------

    def _active(self) -> ColumnElement[bool]:
        """The single definition of "a turn is active": a heartbeat within the staleness window."""
        return and_(
            SESSIONS.c.heartbeat_at.is_not(None),
            SESSIONS.c.heartbeat_at >= ago(self.staleness_seconds),
        )

    def _claimable(self) -> ColumnElement[bool]:
        return or_(
            SESSIONS.c.heartbeat_at.is_(None),
            SESSIONS.c.heartbeat_at < ago(self.staleness_seconds),
        )

    def _session_select(self) -> Any:
        return select(*SESSIONS.c, type_coerce(self._active(), Boolean).label("is_turn_active"))

    @staticmethod
    def _info(row: Row[Any]) -> SessionInfo:
        return SessionInfo(
            id=row.id,
            project_name=row.project_name,
            project_session_id=row.project_session_id,
            user_id=row.user_id,
            title=row.title,
            expires_at=row.expires_at,
            heartbeat_at=row.heartbeat_at,
            model_provider=row.model_provider,
            model_name=row.model_name,
            custom_provider_id=row.custom_provider_id,
            builtin_provider=row.builtin_provider,
            created_at=row.created_at,
            updated_at=row.updated_at,
            is_turn_active=bool(row.is_turn_active),
        )

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
                    self._session_select().where(
                        SESSIONS.c.project_name == project_name,
                        SESSIONS.c.project_session_id == project_session_id,
                    )
                )
            ).first()
        return None if row is None else self._info(row)

    async def get_session(self, session_id: int) -> SessionInfo:
        async with self.db.read() as conn:
            row = (
                await conn.execute(self._session_select().where(SESSIONS.c.id == session_id))
            ).first()
        if row is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        return self._info(row)

    async def list_sessions(
        self, *, user_id: int | None = None, project_name: str | None = None, limit: int = 50
    ) -> list[SessionInfo]:
        """Most recently updated first; the ``(user_id, updated_at)`` index serves user lists."""
        stmt = self._session_select()
        if user_id is not None:
            stmt = stmt.where(SESSIONS.c.user_id == user_id)
        if project_name is not None:
            stmt = stmt.where(SESSIONS.c.project_name == project_name)
        stmt = stmt.order_by(SESSIONS.c.updated_at.desc(), SESSIONS.c.id.desc()).limit(limit)
        async with self.db.read() as conn:
            return [self._info(row) for row in await conn.execute(stmt)]

    async def is_turn_active(self, session_id: int) -> bool:
        """The one "busy" predicate every surface polls (SPEC §6.9); reads, never writes."""
        async with self.db.read() as conn:
            active = await conn.scalar(
                select(type_coerce(self._active(), Boolean)).where(SESSIONS.c.id == session_id)
            )
        if active is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        return bool(active)

    async def set_title(self, session_id: int, title: str, actor: Actor) -> None:
        async with self.db.write() as conn:
            await self._owned(conn, session_id, actor)
            await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id)
                .values(title=shorten(title), updated_at=db_now())
            )

    async def delete_session(self, session_id: int, actor: Actor) -> None:
        """Owner or admin only; refused while a turn is active, like a rewind."""
        async with self.db.write() as conn:
            await self._owned(conn, session_id, actor)
            result = await conn.execute(
                delete(SESSIONS).where(SESSIONS.c.id == session_id, self._claimable())
            )
            if result.rowcount == 0:
                raise AgentSessionBusy(f"session {session_id} has a turn in progress")

    async def _owned(self, conn: AsyncConnection, session_id: int, actor: Actor) -> int | None:
        owner = (
            await conn.execute(select(SESSIONS.c.user_id).where(SESSIONS.c.id == session_id))
        ).first()
        if owner is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        if not actor.may_manage(owner.user_id):
            raise AgentSessionForbidden(
                f"only the session's owner or an admin may change session {session_id}"
            )
        return owner.user_id  # type: ignore[no-any-return]

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
                .where(SESSIONS.c.id == session_id, self._claimable())
                .values(**claim)
            )
            if claimed.rowcount == 0:
                await self._raise_missing_or_busy(conn, session_id)
            tail = await self._tail(conn, session_id)
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
                await self._insert(conn, [message_row(session_id, position, user_message)])
                tail = StoredMessage(user_message["id"], position, user_message, False)
        return TurnLease(session_id=session_id, token=token, tail=tail)

    async def _raise_missing_or_busy(self, conn: AsyncConnection, session_id: int) -> None:
        exists = await conn.scalar(select(SESSIONS.c.id).where(SESSIONS.c.id == session_id))
        if exists is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        raise AgentSessionBusy(f"session {session_id} has a turn in progress")

    async def heartbeat(self, lease: TurnLease) -> None:
        async with self.db.write() as conn:
            await self._fence(conn, lease)

    async def append(
        self, lease: TurnLease, messages: Sequence[Message], *, compaction: bool = False
    ) -> list[StoredMessage]:
        """Append messages of the lease's turn (fenced), refreshing its heartbeat."""
        async with self.db.write() as conn:
            await self._fence(conn, lease)
            return await self._append(conn, lease.session_id, messages, compaction=compaction)

    async def finish(
        self, lease: TurnLease, messages: Sequence[Message] = ()
    ) -> list[StoredMessage]:
        """Append the turn's last messages and release the lock in one transaction."""
        async with self.db.write() as conn:
            await self._fence(conn, lease, release=True)
            return await self._append(conn, lease.session_id, messages)

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

    async def _append(
        self,
        conn: AsyncConnection,
        session_id: int,
        messages: Sequence[Message],
        *,
        compaction: bool = False,
    ) -> list[StoredMessage]:
        if not messages:
            return []
        last = await conn.scalar(
            select(func.max(MESSAGES.c.position)).where(MESSAGES.c.session_id == session_id)
        )
        start = -1 if last is None else int(last)
        rows = [
            message_row(session_id, start + 1 + i, m, compaction=compaction)
            for i, m in enumerate(messages)
        ]
        await self._insert(conn, rows)
        return [
            StoredMessage(r["message_id"], r["position"], r["message"], compaction) for r in rows
        ]

    @staticmethod
    async def _insert(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
        try:
            await conn.execute(insert(MESSAGES), rows)
        except IntegrityError as exc:
            raise DuplicateMessage(
                "a message with this id is already stored: " + str(exc.orig)
            ) from exc

    @staticmethod
    async def _tail(conn: AsyncConnection, session_id: int) -> StoredMessage | None:
        row = (
            await conn.execute(
                select(*_MESSAGE_COLUMNS)
                .where(MESSAGES.c.session_id == session_id)
                .order_by(MESSAGES.c.position.desc())
                .limit(1)
            )
        ).first()
        return None if row is None else _stored(row)

    # -- reading the transcript ---------------------------------------------------------------

    async def tail(self, session_id: int) -> StoredMessage | None:
        async with self.db.read() as conn:
            return await self._tail(conn, session_id)

    async def messages(self, session_id: int, *, after_position: int = -1) -> list[StoredMessage]:
        """The whole persisted transcript after a position (what a client has not shown yet)."""
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(*_MESSAGE_COLUMNS)
                .where(MESSAGES.c.session_id == session_id, MESSAGES.c.position > after_position)
                .order_by(MESSAGES.c.position)
            )
            return [_stored(row) for row in rows]

    async def history(self, session_id: int) -> list[StoredMessage]:
        """The model's view (SPEC §7): the latest checkpoint and everything after it."""
        async with self.db.read() as conn:
            return [_stored(row) for row in await conn.execute(history_statement(session_id))]

    async def find_message(self, message_id: str) -> tuple[int, StoredMessage] | None:
        """The session and stored form of a message, by its id."""
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    select(MESSAGES.c.session_id, *_MESSAGE_COLUMNS).where(
                        MESSAGES.c.message_id == message_id
                    )
                )
            ).first()
        return None if row is None else (int(row.session_id), _stored(row))

    # -- transcript operations ----------------------------------------------------------------

    async def truncate(self, session_id: int, message_id: str, actor: Actor) -> TruncateResult:
        """Rewind (SPEC §7): one transaction, refused while a turn is active.

        A user target is removed with everything after it and its text returned as a draft;
        an assistant target stays and only what follows it goes.
        """
        async with self.db.write() as conn:
            await self._owned(conn, session_id, actor)
            target = await self._message_in(conn, session_id, message_id)
            taken = await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id, self._claimable())
                .values(updated_at=db_now(), heartbeat_at=None, lock_token=None)
            )
            if taken.rowcount == 0:
                raise AgentSessionBusy(f"session {session_id} has a turn in progress")
            is_user = target.role == "user"
            cut = target.position if is_user else target.position + 1
            deleted_ids = (
                await conn.execute(
                    delete(MESSAGES)
                    .where(MESSAGES.c.session_id == session_id, MESSAGES.c.position >= cut)
                    .returning(MESSAGES.c.message_id, MESSAGES.c.position)
                )
            ).all()
            tail = await self._tail(conn, session_id)
        ordered = tuple(row.message_id for row in sorted(deleted_ids, key=lambda r: r.position))
        return TruncateResult(
            deleted=len(ordered),
            draft=message_text(target.message) if is_user else None,
            tail_message_id=tail.message_id if tail else None,
            deleted_message_ids=ordered,
        )

    async def _message_in(
        self, conn: AsyncConnection, session_id: int, message_id: str
    ) -> StoredMessage:
        row = (
            await conn.execute(
                select(*_MESSAGE_COLUMNS).where(
                    MESSAGES.c.session_id == session_id, MESSAGES.c.message_id == message_id
                )
            )
        ).first()
        if row is None:
            raise MessageNotFound(f"message {message_id} is not in session {session_id}")
        return _stored(row)

    async def branch(
        self,
        session_id: int,
        message_id: str,
        *,
        user_id: int | None,
        project_name: str | None = None,
        project_session_id: str | None = None,
    ) -> BranchResult:
        """Fork (SPEC §7): copy the prefix into a new session owned by ``user_id``.

        Every message gets a new id; snapshots of copied messages are copied as references to
        the same content (nothing is duplicated). The source is only read, so this works while
        the source is busy.
        """
        async with self.db.write() as conn:
            source = (
                await conn.execute(select(*SESSIONS.c).where(SESSIONS.c.id == session_id))
            ).first()
            if source is None:
                raise AgentSessionNotFound(f"session {session_id} does not exist")
            target = await self._message_in(conn, session_id, message_id)
            is_user = target.role == "user"
            end = target.position - 1 if is_user else target.position
            prefix = (
                await conn.execute(
                    select(
                        MESSAGES.c.message_id, MESSAGES.c.message, MESSAGES.c.is_compaction_message
                    )
                    .where(MESSAGES.c.session_id == session_id, MESSAGES.c.position <= end)
                    .order_by(MESSAGES.c.position)
                )
            ).all()
            new_id = (
                await conn.execute(
                    insert(SESSIONS)
                    .values(
                        project_name=project_name or source.project_name,
                        project_session_id=project_session_id or f"fork/{uuid.uuid4()}",
                        user_id=user_id,
                        title=source.title,
                        model_provider=source.model_provider,
                        model_name=source.model_name,
                        custom_provider_id=source.custom_provider_id,
                        builtin_provider=source.builtin_provider,
                    )
                    .returning(SESSIONS.c.id)
                )
            ).scalar_one()
            id_map: dict[str, str] = {}
            rows = []
            for position, row in enumerate(prefix):
                copy = with_new_id(row.message)
                id_map[row.message_id] = copy["id"]
                rows.append(
                    message_row(new_id, position, copy, compaction=bool(row.is_compaction_message))
                )
            if rows:
                await self._insert(conn, rows)
                await self._copy_snapshots(conn, session_id, new_id, end, id_map)
            info = (await conn.execute(self._session_select().where(SESSIONS.c.id == new_id))).one()
        return BranchResult(
            session=self._info(info),
            draft=message_text(target.message) if is_user else None,
            copied=len(rows),
            message_id_map=id_map,
        )

    async def _copy_snapshots(
        self,
        conn: AsyncConnection,
        source_id: int,
        new_session_id: int,
        end: int,
        id_map: dict[str, str],
    ) -> None:
        snapshots = (
            await conn.execute(
                select(
                    SNAPSHOTS.c.message_id,
                    SNAPSHOTS.c.content_digest,
                    SNAPSHOTS.c.raw_size,
                    SNAPSHOTS.c.stored_size,
                )
                .join(MESSAGES, MESSAGES.c.message_id == SNAPSHOTS.c.message_id)
                .where(SNAPSHOTS.c.session_id == source_id, MESSAGES.c.position <= end)
            )
        ).all()
        if snapshots:
            await conn.execute(
                insert(SNAPSHOTS),
                [
                    {
                        "message_id": id_map[s.message_id],
                        "session_id": new_session_id,
                        "content_digest": s.content_digest,
                        "raw_size": s.raw_size,
                        "stored_size": s.stored_size,
                    }
                    for s in snapshots
                ],
            )

    # -- bulk loading (benchmarks, imports) -----------------------------------------------------

    async def import_messages(
        self, session_id: int, messages: Iterable[tuple[Message, bool]]
    ) -> int:
        """Append already-written messages outside any turn (refused while a turn is active)."""
        async with self.db.write() as conn:
            taken = await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id, self._claimable())
                .values(updated_at=db_now())
            )
            if taken.rowcount == 0:
                await self._raise_missing_or_busy(conn, session_id)
            last = await conn.scalar(
                select(func.max(MESSAGES.c.position)).where(MESSAGES.c.session_id == session_id)
            )
            start = 0 if last is None else int(last) + 1
            rows = [
                message_row(session_id, start + i, m, compaction=c)
                for i, (m, c) in enumerate(messages)
            ]
            if rows:
                await self._insert(conn, rows)
        return len(rows)
