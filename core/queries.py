"""Predicates and statements the session store's modules share (and the sweeper's predicate).

The lock predicates are defined once here, so "busy" means the same thing to a claim, a rewind,
a deletion, the sweeper and every surface polling ``is_turn_active``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, cast

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Row,
    Select,
    Table,
    and_,
    func,
    insert,
    or_,
    select,
    type_coerce,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from core.db import ago
from core.errors import (
    AgentSessionBusy,
    AgentSessionForbidden,
    AgentSessionNotFound,
    DuplicateMessage,
    MessageNotFound,
)
from core.messages import Message
from core.models import (
    AgentSession,
    AgentSessionMessage,
    AgentSessionSnapshot,
    User,
    validate_message,
)
from core.records import Actor, SessionInfo, StoredMessage

SESSIONS: Final = cast(Table, AgentSession.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
SNAPSHOTS: Final = cast(Table, AgentSessionSnapshot.__table__)
USERS: Final = cast(Table, User.__table__)

AnyRow = Row[*tuple[Any, ...]]

MESSAGE_COLUMNS: Final = (
    MESSAGES.c.message_id,
    MESSAGES.c.position,
    MESSAGES.c.message,
    MESSAGES.c.is_compaction_message,
)


def turn_active(staleness_seconds: float) -> ColumnElement[bool]:
    """The single definition of "a turn is active": a heartbeat within the staleness window."""
    return and_(
        SESSIONS.c.heartbeat_at.is_not(None),
        SESSIONS.c.heartbeat_at >= ago(staleness_seconds),
    )


def claimable(staleness_seconds: float) -> ColumnElement[bool]:
    """The negation of ``turn_active``, written so it can sit in an UPDATE's WHERE clause."""
    return or_(
        SESSIONS.c.heartbeat_at.is_(None),
        SESSIONS.c.heartbeat_at < ago(staleness_seconds),
    )


def session_select(staleness_seconds: float) -> Select[Any]:
    return select(
        *SESSIONS.c, type_coerce(turn_active(staleness_seconds), Boolean).label("is_turn_active")
    )


def session_info(row: AnyRow) -> SessionInfo:
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


def stored(row: AnyRow) -> StoredMessage:
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
        select(*MESSAGE_COLUMNS)
        .where(
            MESSAGES.c.session_id == session_id,
            MESSAGES.c.position.between(
                func.coalesce(latest(MESSAGES.c.is_compaction_message.is_(True)), 0), latest()
            ),
        )
        .order_by(MESSAGES.c.position)
    )


async def tail(conn: AsyncConnection, session_id: int) -> StoredMessage | None:
    row = (
        await conn.execute(
            select(*MESSAGE_COLUMNS)
            .where(MESSAGES.c.session_id == session_id)
            .order_by(MESSAGES.c.position.desc())
            .limit(1)
        )
    ).first()
    return None if row is None else stored(row)


async def message_in(conn: AsyncConnection, session_id: int, message_id: str) -> StoredMessage:
    row = (
        await conn.execute(
            select(*MESSAGE_COLUMNS).where(
                MESSAGES.c.session_id == session_id, MESSAGES.c.message_id == message_id
            )
        )
    ).first()
    if row is None:
        raise MessageNotFound(f"message {message_id} is not in session {session_id}")
    return stored(row)


async def insert_messages(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    try:
        await conn.execute(insert(MESSAGES), rows)
    except IntegrityError as exc:
        raise DuplicateMessage(f"a message with this id is already stored: {exc.orig}") from exc


async def append_messages(
    conn: AsyncConnection, session_id: int, messages: Sequence[tuple[Message, bool]]
) -> list[StoredMessage]:
    """Insert after the current tail; callers hold the session's lock (or its write lock)."""
    if not messages:
        return []
    last = await conn.scalar(
        select(func.max(MESSAGES.c.position)).where(MESSAGES.c.session_id == session_id)
    )
    start = 0 if last is None else int(last) + 1
    rows = [
        message_row(session_id, start + i, message, compaction=compaction)
        for i, (message, compaction) in enumerate(messages)
    ]
    await insert_messages(conn, rows)
    return [
        StoredMessage(r["message_id"], r["position"], r["message"], r["is_compaction_message"])
        for r in rows
    ]


async def check_owner(conn: AsyncConnection, session_id: int, actor: Actor) -> None:
    owner = (
        await conn.execute(select(SESSIONS.c.user_id).where(SESSIONS.c.id == session_id))
    ).first()
    if owner is None:
        raise AgentSessionNotFound(f"session {session_id} does not exist")
    if not actor.may_manage(owner.user_id):
        raise AgentSessionForbidden(
            f"only the session's owner or an admin may change session {session_id}"
        )


async def raise_missing_or_busy(conn: AsyncConnection, session_id: int) -> None:
    """Explain why a conditional UPDATE on a session changed nothing."""
    exists = await conn.scalar(select(SESSIONS.c.id).where(SESSIONS.c.id == session_id))
    if exists is None:
        raise AgentSessionNotFound(f"session {session_id} does not exist")
    raise AgentSessionBusy(f"session {session_id} has a turn in progress")
