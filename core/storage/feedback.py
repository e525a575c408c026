"""Votes on answers (a surface's feedback buttons): one per person and message, the latest
click wins; they go with their message when a rewind or the sweeper deletes it."""

from __future__ import annotations

from typing import Final, cast

from sqlalchemy import Table, func, select

from core.storage.dialect import db_now
from core.storage.engine import Database
from core.storage.models import AgentSessionMessage, MessageFeedback

FEEDBACK: Final = cast(Table, MessageFeedback.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
VALUES: Final = ("good", "bad")


async def record_vote(db: Database, message_id: str, voter: str, value: str) -> bool:
    """Store (or change) ``voter``'s vote on an answer; False when the message is gone (rewound
    away) or the value is not a vote."""
    if value not in VALUES:
        return False
    async with db.write() as conn:
        exists = await conn.scalar(
            select(MESSAGES.c.id).where(
                MESSAGES.c.message_id == message_id,
                MESSAGES.c.message["role"].as_string() == "assistant",
            )
        )
        if exists is None:
            return False
        stmt = db.upsert(FEEDBACK).values(message_id=message_id, voter=voter, value=value)
        await conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["message_id", "voter"],
                set_={"value": stmt.excluded.value, "updated_at": db_now()},
            )
        )
    return True


async def votes(db: Database, session_id: int) -> dict[str, dict[str, int]]:
    """The votes on a session's answers: message id -> {"good": n, "bad": m}."""
    async with db.read() as conn:
        rows = await conn.execute(
            select(FEEDBACK.c.message_id, FEEDBACK.c.value, func.count().label("n"))
            .join(MESSAGES, MESSAGES.c.message_id == FEEDBACK.c.message_id)
            .where(MESSAGES.c.session_id == session_id)
            .group_by(FEEDBACK.c.message_id, FEEDBACK.c.value)
        )
        found: dict[str, dict[str, int]] = {}
        for row in rows:
            found.setdefault(str(row.message_id), {})[str(row.value)] = int(row.n)
    return found


class Feedback:
    """Votes bound to one database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def record(self, message_id: str, voter: str, value: str) -> bool:
        return await record_vote(self._db, message_id, voter, value)

    async def of_session(self, session_id: int) -> dict[str, dict[str, int]]:
        return await votes(self._db, session_id)
