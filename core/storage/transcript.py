"""Transcript operations of the session store: reading, rewind (truncate) and fork (branch).

Each public method is one transaction. ``truncate`` is refused while a turn is active and clears
a stale lock's fencing token, so the dead turn that held it cannot write afterwards. ``branch``
only reads the source's persisted messages, so it is allowed while the source is busy.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import BigInteger, Insert, Text, cast, delete, func, insert, literal, select, update

from core.errors import AgentSessionBusy, AgentSessionNotFound
from core.messages import Message, message_text
from core.records import Actor, BranchResult, StoredMessage, TruncateResult
from core.storage import queries as q
from core.storage.dialect import copied_message_id, db_now, json_with_id
from core.storage.engine import Conn, Database
from core.storage.models import Id

MESSAGES = q.MESSAGES
SESSIONS = q.SESSIONS
SNAPSHOTS = q.SNAPSHOTS


class TranscriptOperations:
    """Mixed into ``SessionStore``; needs only its database and staleness window."""

    db: Database
    staleness_seconds: float

    async def tail(self, session_id: int) -> StoredMessage | None:
        return await q.read_tail(self.db, session_id)

    async def messages(
        self,
        session_id: int,
        *,
        after_position: int = -1,
        containing: str | None = None,
        limit: int | None = None,
    ) -> list[StoredMessage]:
        """The persisted transcript after a position (what a client has not shown yet);
        ``containing``: only the messages whose JSON has that text (found by the database, so
        a rewind's confirmation reads just the few messages that called an MCP tool);
        ``limit``: at most that many (a page of the HTTP API's transcript)."""
        where = [MESSAGES.c.session_id == session_id, MESSAGES.c.position > after_position]
        if containing is not None:
            where.append(cast(MESSAGES.c.message, Text).contains(containing, autoescape=True))
        async with self.db.read(large=True) as conn:
            stmt = select(*q.MESSAGE_COLUMNS).where(*where).order_by(MESSAGES.c.position)
            if limit is not None:
                stmt = stmt.limit(limit)
            rows = await conn.execute(stmt)
            return [q.stored(row) for row in rows]

    async def page(
        self, session_id: int, *, after_position: int, limit: int
    ) -> list[tuple[StoredMessage, datetime]]:
        """Up to ``limit`` messages after a position, oldest first, each with when it was
        stored (a client's page of the transcript shows it)."""
        async with self.db.read(large=True) as conn:
            rows = await conn.execute(
                select(*q.MESSAGE_COLUMNS, MESSAGES.c.created_at)
                .where(MESSAGES.c.session_id == session_id, MESSAGES.c.position > after_position)
                .order_by(MESSAGES.c.position)
                .limit(limit)
            )
            return [(q.stored(row), row.created_at) for row in rows]

    async def tails(self, session_ids: Iterable[int]) -> dict[int, str]:
        """The last message id of each of these sessions that has one, in one query (a list of
        sessions shows each one's ``lastMessageId``)."""
        ids = sorted(set(session_ids))
        if not ids:
            return {}
        last = (
            select(MESSAGES.c.session_id, func.max(MESSAGES.c.position).label("position"))
            .where(MESSAGES.c.session_id.in_(ids))
            .group_by(MESSAGES.c.session_id)
            .subquery()
        )
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(MESSAGES.c.session_id, MESSAGES.c.message_id).join(
                    last,
                    (MESSAGES.c.session_id == last.c.session_id)
                    & (MESSAGES.c.position == last.c.position),
                )
            )
            return {int(r.session_id): str(r.message_id) for r in rows}

    async def count_after(self, session_id: int, position: int) -> int:
        """How many messages come after ``position``, counted by the database (a rewind's
        confirmation says it; no message needs reading for that)."""
        async with self.db.read() as conn:
            found = await conn.scalar(
                select(func.count()).where(
                    MESSAGES.c.session_id == session_id, MESSAGES.c.position > position
                )
            )
        return int(found or 0)

    async def history(self, session_id: int) -> list[StoredMessage]:
        """The model's view: the latest checkpoint and everything after it."""
        return await q.history(self.db, session_id)

    async def find_message(self, message_id: str) -> tuple[int, StoredMessage] | None:
        """The session and stored form of a message, by its id."""
        async with self.db.read() as conn:
            row = (
                await conn.execute(
                    select(MESSAGES.c.session_id, *q.MESSAGE_COLUMNS).where(
                        MESSAGES.c.message_id == message_id
                    )
                )
            ).first()
        return None if row is None else (int(row.session_id), q.stored(row))

    async def truncate(self, session_id: int, message_id: str, actor: Actor) -> TruncateResult:
        """Rewind, owner or admin only.

        A user target is removed with everything after it and its text returned as a draft;
        an assistant target stays and only what follows it goes, and so does a checkpoint
        (``StoredMessage.returns_as_draft``: rewinding *at* a checkpoint returns to just after
        that compaction; nothing comes back as a draft). Snapshots of deleted messages
        go with them (FK cascade), so the sandbox state becomes that of the new tail.
        Inline on SQLite (not ``large``): a rewind usually removes a few messages, and the
        seven thread hops of a threaded write cost more than that under load
        (docs/benchmarks.md, *Figures behind choices in the code*).
        """
        async with self.db.write() as conn:
            await q.check_owner(conn, session_id, actor)
            # Lock first, then read: under READ COMMITTED a turn releasing between a read of
            # the target and the lock could have moved it (auto-compaction moves the turn's
            # user message up one position), and the cut would take the checkpoint with it.
            taken = await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id, q.claimable(self.staleness_seconds))
                .values(updated_at=db_now(), heartbeat_at=None, lock_token=None)
            )
            if taken.rowcount == 0:
                raise AgentSessionBusy(f"session {session_id} has a turn in progress")
            target = await q.message_in(conn, session_id, message_id)
            is_user = target.returns_as_draft
            cut = target.position if is_user else target.position + 1
            going = (MESSAGES.c.session_id == session_id) & (MESSAGES.c.position >= cut)
            if conn.dialect.name == "postgresql":
                deleted = (
                    await conn.execute(
                        delete(MESSAGES)
                        .where(going)
                        .returning(MESSAGES.c.message_id, MESSAGES.c.position)
                    )
                ).all()
            else:  # no RETURNING before SQLite 3.35; the write lock keeps the two together
                deleted = (
                    await conn.execute(
                        select(MESSAGES.c.message_id, MESSAGES.c.position).where(going)
                    )
                ).all()
                await conn.execute(delete(MESSAGES).where(going))
            await q.set_tail(conn, session_id)
            tail = await q.tail(conn, session_id)
        ordered = tuple(row.message_id for row in sorted(deleted, key=lambda r: r.position))
        return TruncateResult(
            deleted=len(ordered),
            draft=message_text(target.message) if is_user else None,
            tail_message_id=tail.message_id if tail else None,
            deleted_message_ids=ordered,
        )

    async def branch(
        self,
        session_id: int,
        message_id: str,
        *,
        user_id: int | None,
        project_name: str | None = None,
        project_session_id: str | None = None,
    ) -> BranchResult:
        """Fork: copy the prefix into a new session owned by ``user_id``.

        Up to the target for an assistant message or a checkpoint (the fork starts from that
        compacted state, no draft), up to just before it (returned as a draft) for a user
        message. Every message gets a new id; snapshots of copied messages are copied
        as references to the same content, so nothing is duplicated.
        """
        # One snapshot for every read of the source (PostgreSQL): a rewind of the source
        # committing between them would leave copied rows without their snapshots.
        async with self.db.write(consistent=True, large=True) as conn:
            source = (
                await conn.execute(select(*SESSIONS.c).where(SESSIONS.c.id == session_id))
            ).first()
            if source is None:
                raise AgentSessionNotFound(f"session {session_id} does not exist")
            target = await q.message_in(conn, session_id, message_id)
            is_user = target.returns_as_draft
            end = target.position - 1 if is_user else target.position
            inserted = (
                await conn.execute(
                    insert(SESSIONS).values(
                        project_name=project_name or source.project_name,
                        project_session_id=project_session_id or f"fork/{uuid.uuid4()}",
                        user_id=user_id,
                        title=source.title,
                        model_provider=source.model_provider,
                        model_name=source.model_name,
                        custom_provider_id=source.custom_provider_id,
                        builtin_provider=source.builtin_provider,
                    )
                )
            ).inserted_primary_key
            assert inserted is not None
            new_id = int(inserted[0])
            copied = await conn.execute(_copy_prefix(session_id, new_id, end))
            await q.set_tail(conn, new_id)
            await _copy_snapshots(conn, session_id, new_id, end)
            info = (
                await conn.execute(
                    q.session_select(self.staleness_seconds).where(SESSIONS.c.id == new_id)
                )
            ).one()
        return BranchResult(
            session=q.session_info(info),
            draft=message_text(target.message) if is_user else None,
            copied=int(copied.rowcount),
        )

    async def import_messages(
        self, session_id: int, messages: Iterable[tuple[Message, bool]]
    ) -> int:
        """Append already-written ``(message, is_checkpoint)`` pairs outside any turn.

        For imports and benchmarks; refused while a turn is active, like every other writer.
        A stale lock is cleared with its fencing token, as a rewind does, so the dead turn that
        held it cannot write after the imported messages.
        """
        async with self.db.write(large=True) as conn:
            taken = await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == session_id, q.claimable(self.staleness_seconds))
                .values(updated_at=db_now(), heartbeat_at=None, lock_token=None)
            )
            if taken.rowcount == 0:
                await q.raise_missing_or_busy(conn, session_id)
            start = await q.next_position(conn, session_id)
            appended = await q.append_messages(conn, session_id, start, list(messages))
            await q.set_tail(conn, session_id)
            return len(appended)


def _copy_prefix(source_id: int, new_session_id: int, end: int) -> Insert:
    """Copy messages ``0..end`` under new ids in one statement: no row passes through Python.

    The new id is used twice, for ``message_id`` and inside the JSON, so the two must be equal
    (the invariant ``validate_message`` keeps for rows written from Python). It is computed
    from the row's position and a per-fork nonce, so evaluating it twice gives the same id
    (``copied_message_id``), and the rows go straight from the source to the copy: no CTE
    (Python's sqlite3 reports no row count for a statement that starts with ``WITH``, and
    PostgreSQL's materialised one was a second copy of the whole prefix).
    """
    columns = ["session_id", "position", "message", "message_id", "is_compaction_message"]
    new_id = copied_message_id(
        MESSAGES.c.position,
        literal(uuid.uuid4().hex[:10]),
        literal(time.time_ns() // 1_000_000, BigInteger()),
    )
    rows = select(
        literal(new_session_id, Id),
        MESSAGES.c.position,
        json_with_id(MESSAGES.c.message, new_id, MESSAGES.c.message_id),
        new_id,
        MESSAGES.c.is_compaction_message,
    ).where((MESSAGES.c.session_id == source_id) & (MESSAGES.c.position <= end))
    return insert(MESSAGES).from_select(columns, rows)


async def _copy_snapshots(conn: Conn, source_id: int, new_session_id: int, end: int) -> None:
    """The fork's snapshots: new rows naming the same content, so nothing is duplicated."""
    from core.storage.snapshots import copy_snapshots  # all SQL on snapshot tables lives there

    await copy_snapshots(
        conn, source_session_id=source_id, new_session_id=new_session_id, up_to_position=end
    )
