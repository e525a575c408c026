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
builds SQL; the statements live here, in ``core.storage.transcript``, ``core.storage.queries`` and
the sweeper.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import (
    Boolean,
    Float,
    String,
    and_,
    bindparam,
    delete,
    func,
    or_,
    select,
    type_coerce,
    update,
)
from sqlalchemy.exc import IntegrityError

from core import metrics
from core.errors import (
    AgentSessionBudgetExceeded,
    AgentSessionBusy,
    AgentSessionLockLost,
    AgentSessionNotFound,
    AgentSessionStale,
)
from core.messages import Message, message_text, shorten
from core.records import (
    Actor,
    AnyTail,
    ModelChoice,
    SessionInfo,
    StoredMessage,
    TurnLease,
)
from core.storage import advisory
from core.storage import queries as q
from core.storage.custom_providers import CustomProviders
from core.storage.dialect import db_now, in_json_ids, insert_ignoring, json_ids
from core.storage.engine import Conn, Database
from core.storage.prepared import Prepared
from core.storage.snapshots import SnapshotRef, Snapshots, attach_snapshot
from core.storage.transcript import TranscriptOperations
from core.storage.usage import Reservation

SESSIONS: Final = q.SESSIONS
USERS: Final = q.USERS

# -- every turn's look-ups, built once with bind parameters (``core.storage.prepared``) ------------

_EXTERNAL_ID: Final = bindparam("external_id", type_=USERS.c.external_id.type)
_USER_ID: Final = Prepared(select(USERS.c.id).where(USERS.c.external_id == _EXTERNAL_ID))
_ADD_USER: Final = insert_ignoring(
    USERS,
    {
        "external_id": _EXTERNAL_ID,
        "display_name": bindparam("display_name", type_=USERS.c.display_name.type),
    },
    ("external_id",),
)
_PROJECT: Final = bindparam("project_name", type_=SESSIONS.c.project_name.type)
_KEY: Final = bindparam("project_session_id", type_=SESSIONS.c.project_session_id.type)
# ``q.session_select`` with the staleness window a parameter (``staleness``), found by project
# key or by id (every turn reads its session first, for its model).
_SESSION_COLUMNS: Final = (
    *q.SESSION_FIELDS,
    type_coerce(q.TURN_ACTIVE_BOUND, Boolean).label("is_turn_active"),
)
_SESSION_ROW: Final = select(*_SESSION_COLUMNS)
_FIND_SESSION: Final = Prepared(
    _SESSION_ROW.where(SESSIONS.c.project_name == _PROJECT, SESSIONS.c.project_session_id == _KEY)
)
_GET_SESSION: Final = Prepared(
    _SESSION_ROW.where(SESSIONS.c.id == bindparam("session_id", type_=SESSIONS.c.id.type))
)
# The running turns asked to stop, among sessions given as a JSON array (``ids``): polled every
# second for all of a process's turns, however many.
_STOPS: Final = Prepared(
    select(SESSIONS.c.id, SESSIONS.c.stop_token).where(
        in_json_ids(SESSIONS.c.id, bindparam("ids", type_=String())),
        SESSIONS.c.stop_token.is_not(None),
    )
)
_NEW_SESSION: Final[dict[str, Any]] = {
    "project_name": _PROJECT,
    "project_session_id": _KEY,
    "user_id": bindparam("user_id", type_=SESSIONS.c.user_id.type),
    "title": bindparam("title", type_=SESSIONS.c.title.type),
}
# By whether the session is returned (RETURNING, where the database has it: the row as
# ``_SESSION_ROW`` reads it, so a new thread's session is not read back), by temporary (which
# expires ``ttl_seconds`` from now, on the database clock), then dialect.
_ADD_SESSION: Final = {
    returned: {
        temporary: insert_ignoring(
            SESSIONS,
            (
                {**_NEW_SESSION, "expires_at": db_now(bindparam("ttl_seconds", type_=Float()))}
                if temporary
                else _NEW_SESSION
            ),
            ("project_name", "project_session_id"),
            returning=_SESSION_COLUMNS if returned else (),
        )
        for temporary in (False, True)
    }
    for returned in (False, True)
}


# A claim that took a stale lock over gets a token starting with this (never a hex digit), so
# the one claim statement also tells whether a dead or stuck turn held the lock before.
TAKEOVER_MARK: Final = "t"
# How many times a claim is tried when it was refused but the reason was gone by the time it
# was read (``q.ClaimMissed``): the lock went stale, or its turn ended without an answer, in
# between. Past that the claim is refused as busy (it was, a moment ago).
CLAIM_ATTEMPTS: Final = 3


class SessionStore(TranscriptOperations):
    """Sessions, their users, their transcripts and the turn lock.

    A session's sandbox snapshots and the custom providers its model may name are reached
    through it (``snapshots``, ``custom_providers``), so the agent holds the store alone and
    never the database under it.
    """

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
        self._held = _HeldLeases(self.staleness_seconds)
        # Sessions whose turn here ended without the database confirming its release (it was
        # unreachable): their token, which this process's next claim may take back at once.
        self._abandoned: dict[int, str] = {}
        self._claiming = _KeyedLocks()
        self.snapshots = Snapshots(db)
        self.custom_providers = CustomProviders(db)

    # -- users and sessions -------------------------------------------------------------------

    async def get_or_create_user(self, external_id: str, display_name: str | None = None) -> int:
        """Idempotent under concurrency: replicas meeting a new user at once agree on one row.

        Read first: users are never deleted, so a known one (every turn but a person's first)
        costs a read, not a write transaction.
        """
        known = await _USER_ID.fetch(self.db, {"external_id": external_id})
        if known:
            return int(known[0][0])
        async with self.db.write() as conn:
            params = {"external_id": external_id, "display_name": display_name}
            await _ADD_USER[conn.dialect.name].run(conn, params)
            user_id = (await _USER_ID.run(conn, params)).row
        assert user_id is not None
        return int(user_id[0])

    async def find_user(self, external_id: str) -> int | None:
        """The user row of ``external_id``, if there is one (nothing is created)."""
        known = await _USER_ID.fetch(self.db, {"external_id": external_id})
        return int(known[0][0]) if known else None

    async def people(self, user_ids: list[int]) -> dict[int, tuple[str, str | None]]:
        """Who these users are: external id and display name, in one query."""
        if not user_ids:
            return {}
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(USERS.c.id, USERS.c.external_id, USERS.c.display_name).where(
                    USERS.c.id.in_(sorted(set(user_ids)))
                )
            )
            return {int(r.id): (str(r.external_id), r.display_name) for r in rows}

    async def user_external_id(self, user_id: int) -> str | None:
        """Who a user is (``slack:T…:U…``, ``cli:<login>``), for surfaces that name an owner."""
        async with self.db.read() as conn:
            found = await conn.scalar(select(USERS.c.external_id).where(USERS.c.id == user_id))
        return None if found is None else str(found)

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
        params: dict[str, Any] = {
            "project_name": project_name,
            "project_session_id": project_session_id,
            "user_id": user_id,
            "title": shorten(title) if title else None,
            "ttl_seconds": self.temporary_ttl_hours * 3600,
        }
        async with self.db.autocommit() as conn:
            returned = bool(conn.dialect.insert_returning)
            if returned:
                params["staleness"] = self.staleness_seconds
            ran = await _ADD_SESSION[returned][temporary][conn.dialect.name].run(conn, params)
        if ran.row is not None:
            return q.session_info(cast(q.AnyRow, ran.row)), True  # named by column, as a Row
        created = ran.rowcount == 1 and not returned  # returned: another caller created it
        session = await self.find_session(project_name, project_session_id)
        if session is None:  # deleted between the two statements: treat as not found
            raise AgentSessionNotFound(f"session {project_name}/{project_session_id} vanished")
        return session, created

    async def find_session(self, project_name: str, project_session_id: str) -> SessionInfo | None:
        params = {
            "project_name": project_name,
            "project_session_id": project_session_id,
            "staleness": self.staleness_seconds,
        }
        rows = await _FIND_SESSION.fetch(self.db, params)
        return q.session_info(rows[0]) if rows else None

    async def get_session(self, session_id: int) -> SessionInfo:
        params = {"session_id": session_id, "staleness": self.staleness_seconds}
        rows = await _GET_SESSION.fetch(self.db, params)
        if not rows:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        return q.session_info(rows[0])

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

    async def visible(
        self,
        *,
        user_id: int | None,
        shared: Sequence[tuple[str, str]] = (),
        everything: bool = False,
        workspace: Sequence[tuple[str, str]] = (),
        before: tuple[datetime, int] | None = None,
        words: str | None = None,
        limit: int = 50,
    ) -> list[SessionInfo]:
        """A page of the sessions a person sees, most recently updated first: those
        ``user_id`` owns, those of a project whose key starts with a prefix of ``shared``
        (``(project_name, key_prefix)``: a Slack channel's threads), or all (``everything``): of
        the projects ``workspace`` names, those whose key starts with its prefix (one Slack
        workspace's), and every session of the other projects (the terminal's).
        ``before``: the ``(updated_at, id)`` of the previous page's last session. ``words``:
        only titles containing them (case-insensitive)."""
        stmt = q.session_select(self.staleness_seconds)
        if not everything:
            seen = [SESSIONS.c.user_id == user_id] if user_id is not None else []
            for project, prefix in shared:
                seen.append(
                    and_(
                        SESSIONS.c.project_name == project,
                        SESSIONS.c.project_session_id.startswith(prefix, autoescape=True),
                    )
                )
            if not seen:
                return []
            stmt = stmt.where(or_(*seen))
        elif workspace:
            stmt = stmt.where(
                or_(
                    SESSIONS.c.project_name.not_in(sorted({p for p, _ in workspace})),
                    *(
                        and_(
                            SESSIONS.c.project_name == project,
                            SESSIONS.c.project_session_id.startswith(prefix, autoescape=True),
                        )
                        for project, prefix in workspace
                    ),
                )
            )
        if before is not None:
            at, last_id = before
            stmt = stmt.where(
                or_(
                    SESSIONS.c.updated_at < at,
                    and_(SESSIONS.c.updated_at == at, SESSIONS.c.id < last_id),
                )
            )
        if words:
            stmt = stmt.where(
                func.lower(func.coalesce(SESSIONS.c.title, "")).contains(
                    words.lower(), autoescape=True
                )
            )
        stmt = stmt.order_by(SESSIONS.c.updated_at.desc(), SESSIONS.c.id.desc()).limit(limit)
        async with self.db.read() as conn:
            return [q.session_info(row) for row in await conn.execute(stmt)]

    async def is_turn_active(self, session_id: int) -> bool:
        """The one "busy" predicate every surface polls; reads, never writes."""
        async with self.db.read() as conn:
            active = await conn.scalar(
                select(type_coerce(q.turn_active(self.staleness_seconds), Boolean)).where(
                    SESSIONS.c.id == session_id
                )
            )
        if active is None:
            raise AgentSessionNotFound(f"session {session_id} does not exist")
        return bool(active)

    async def active_among(self, session_ids: set[int]) -> set[int]:
        """Which of these sessions have a turn running (``is_turn_active`` for many at once)."""
        if not session_ids:
            return set()
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(SESSIONS.c.id).where(
                    SESSIONS.c.id.in_(list(session_ids)), q.turn_active(self.staleness_seconds)
                )
            )
            return {int(r) for r in rows.scalars()}

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

    # -- stopping a running turn from anywhere -------------------------------------------------

    async def request_stop(self, session_id: int) -> bool:
        """Ask the turn running on a session to stop (a stop button, on any replica).

        One UPDATE that marks the running turn's token; it neither waits for nor takes the
        lock. The process running the turn notices within ``core.agent.stops.STOP_POLL_SECONDS``.
        False when no turn is running: a stop for an idle session changes nothing.
        """
        async with self.db.write() as conn:
            result = await conn.execute(
                update(SESSIONS)
                .where(
                    SESSIONS.c.id == session_id,
                    SESSIONS.c.lock_token.is_not(None),
                    q.turn_active(self.staleness_seconds),
                )
                .values(stop_token=SESSIONS.c.lock_token)
            )
            return bool(result.rowcount)

    async def request_stops(self, project_name: str, key_prefix: str) -> int:
        """``request_stop`` for every running turn of a project's sessions whose key starts
        with ``key_prefix`` (a workspace uninstalling the app); how many were running."""
        async with self.db.write() as conn:
            result = await conn.execute(
                update(SESSIONS)
                .where(
                    SESSIONS.c.project_name == project_name,
                    SESSIONS.c.project_session_id.startswith(key_prefix, autoescape=True),
                    SESSIONS.c.lock_token.is_not(None),
                    q.turn_active(self.staleness_seconds),
                )
                .values(stop_token=SESSIONS.c.lock_token)
            )
            return int(result.rowcount)

    async def stops_requested(self, leases: Sequence[TurnLease]) -> set[int]:
        """Which of these running turns were asked to stop (one query for all of them)."""
        if not leases:
            return set()
        tokens = {lease.session_id: lease.token for lease in leases}
        rows = await _STOPS.fetch(self.db, {"ids": json_ids(tokens)})
        return {int(sid) for sid, stop in rows if stop == tokens.get(int(sid))}

    # -- the turn lock ------------------------------------------------------------------------

    async def start_turn(
        self,
        session_id: int,
        *,
        user_message: Message | None,
        last_message_id: str | AnyTail | None,
        model: ModelChoice | None = None,
        reservation: Reservation | None = None,
    ) -> TurnLease:
        """Stale guard, claim, stamp and persist the user message, atomically.

        ``last_message_id=ANY_TAIL`` skips the stale guard (compaction, which adds no user text).
        ``reservation``: the budget check and reservation (``core.storage.usage``), run last in
        the same transaction, so a turn over its budget is refused with nothing written.
        Claims on one session from this process queue here, and while this process holds the
        session's live lease the answer is ``agent_session_busy`` without asking the database.
        """
        try:
            self._held.refuse_if_live(session_id)
            async with self._claiming.hold(session_id):
                self._held.refuse_if_live(session_id)
                lease = await self._claim(
                    session_id, user_message, last_message_id, model, reservation
                )
                self._held.confirm(lease)
                self._abandoned.pop(session_id, None)
        except AgentSessionBusy:
            metrics.TURN_REFUSALS.labels("busy").inc()
            raise
        except AgentSessionStale:
            metrics.TURN_REFUSALS.labels("stale").inc()
            raise
        except AgentSessionBudgetExceeded:
            metrics.TURN_REFUSALS.labels("budget").inc()
            raise
        if lease.token.startswith(TAKEOVER_MARK):
            metrics.LOCK_TAKEOVERS.inc()
        return lease

    async def _claim(
        self,
        session_id: int,
        user_message: Message | None,
        last_message_id: str | AnyTail | None,
        model: ModelChoice | None,
        reservation: Reservation | None = None,
    ) -> TurnLease:
        token = uuid.uuid4().hex
        params: dict[str, Any] = {
            "sid": session_id,
            "token": token,
            "takeover_token": TAKEOVER_MARK + token[1:],
            "staleness": self.staleness_seconds,
            "title": None,
            "abandoned": self._abandoned.get(session_id),
            "any_tail": isinstance(last_message_id, AnyTail),
            "last": None if isinstance(last_message_id, AnyTail) else last_message_id,
            "new_tail": None,
        }
        row: dict[str, Any] | None = None
        if user_message is not None:
            row = q.message_row(session_id, 0, user_message)  # validates it
            params.update(q.user_params(row))
            params["title"] = shorten(message_text(user_message)) or None
        if model is not None:
            params.update(
                provider=model.provider,
                model_name=model.name,
                custom_provider_id=model.custom_provider_id,
                builtin_provider=model.builtin_provider,
            )
        stamp = model is not None
        for _ in range(CLAIM_ATTEMPTS):
            with contextlib.suppress(q.ClaimMissed):
                return await self._claim_once(
                    session_id, user_message, row, params, stamp, reservation
                )
        raise AgentSessionBusy(f"session {session_id} has a turn in progress")

    async def _claim_once(
        self,
        session_id: int,
        user_message: Message | None,
        row: dict[str, Any] | None,
        params: dict[str, Any],
        stamp: bool,
        reservation: Reservation | None,
    ) -> TurnLease:
        """One try of the claim: its lease, or why it was refused (raised; ``q.ClaimMissed``
        when the reason was gone by the time it was read, and the claim may be tried again).

        On PostgreSQL a turn with a user message and no budget to check is one autocommitted
        statement (``q.claim_inserting``: the claim, its stale guard and the insert); one with
        budgets is one too when it can be (``claim_admitting`` ``at_once``: the accounts'
        advisory locks tried, never waited on, the claim, the budget's admission, the
        reservation and the insert; not tried while most of the database's recent tries fell
        back, ``advisory.AtOnce``), and otherwise a transaction that waits for the locks
        (BEGIN and the locks in one round trip, ``advisory.locked``), then runs that statement
        without its own locks (``claim_admitting``), then COMMIT. The rest is a transaction:
        the claim, then the user message's insert and the budget check; a budgeted claim on
        PostgreSQL neither statement admitted goes that way too, under the locks it holds, and
        is refused in words or admitted."""
        budgeted = reservation is not None and bool(reservation.pairs)
        if self.db.dialect == "postgresql" and row is not None and not budgeted:
            assert user_message is not None
            async with self.db.autocommit() as conn:
                got = await q.claim_inserting(conn, params, stamp=stamp)
            if got is None:
                raise await q.fetch_refusal(self.db, session_id, params)
            return _leased(session_id, row, user_message, got)
        if self.db.dialect == "postgresql" and budgeted:
            assert reservation is not None
            if row is not None and reservation.in_sql:
                assert user_message is not None
                got = await advisory.tried_at_once(
                    self.db,
                    lambda conn: reservation.claim_admitting(
                        conn, params, stamp=stamp, at_once=True
                    ),
                )
                if got is not None:
                    return _leased(session_id, row, user_message, got)
            async with advisory.locked(self.db, reservation.lock_keys) as conn:
                if row is not None:
                    assert user_message is not None
                    got = await reservation.claim_admitting(conn, params, stamp=stamp)
                    if got is not None:
                        return _leased(session_id, row, user_message, got)
                return await self._claim_in(
                    conn, session_id, user_message, row, params, stamp, reservation, True
                )
        async with self.db.write() as conn:
            return await self._claim_in(
                conn, session_id, user_message, row, params, stamp, reservation, False
            )

    async def _claim_in(
        self,
        conn: Conn,
        session_id: int,
        user_message: Message | None,
        row: dict[str, Any] | None,
        params: dict[str, Any],
        stamp: bool,
        reservation: Reservation | None,
        locked: bool,
    ) -> TurnLease:
        """The claim in the caller's transaction, then the rest of it (``_claimed``).
        ``locked``: the transaction holds the budget's advisory locks already."""
        claimed = await q.claim(conn, params, stamp=stamp)
        if claimed is None:
            raise await q.read_refusal(conn, session_id, params)
        return await self._claimed(
            conn, session_id, claimed, user_message, row, reservation, locked
        )

    async def _claimed(
        self,
        conn: Conn,
        session_id: int,
        token: str,
        user_message: Message | None,
        row: dict[str, Any] | None,
        reservation: Reservation | None,
        locked: bool,
    ) -> TurnLease:
        """The rest of the claim transaction, once the claim (and its stale guard) held: the
        user message (``row``) and the budget check (``locked``: the transaction holds the
        budget's advisory locks, PostgreSQL). The stale guard ran first, so a turn that is
        stale was refused as stale even when it is over its budget too: the client's view is
        the first thing to set right."""
        if row is None:
            tail = await q.tail(conn, session_id)
            if reservation is not None:
                await reservation.take(conn, session_id, token)
            position = tail.position + 1 if tail else 0
            return TurnLease(session_id=session_id, token=token, tail=tail, next_position=position)
        assert user_message is not None
        if reservation is not None and locked:
            # The reservation is written by the user message's insert (a round trip less).
            # The check's read follows the locks, so it sees what their last holder committed.
            try:
                inserted_at = await reservation.take_inserting(
                    conn, session_id, token, q.user_params(row)
                )
            except IntegrityError as exc:
                raise q.message_integrity_error(exc) from exc
        else:
            inserted_at = await q.insert_next(conn, row)
            if reservation is not None:
                await reservation.take(conn, session_id, token)
        message = StoredMessage(row["message_id"], inserted_at, user_message, False)
        return TurnLease(session_id, token, message, next_position=inserted_at + 1)

    def abandon(self, lease: TurnLease) -> None:
        """The lease's turn ended here but its release did not reach the database: its lock
        stays set there until the window passes. The turn is over, so this process's next
        claim of the session may take that lock back at once (its own retry of the message
        must not be refused as busy by a turn that no longer runs). Another process still
        waits for the window."""
        self._held.forget(lease)
        self._abandoned[lease.session_id] = lease.token

    async def heartbeat(self, lease: TurnLease) -> None:
        await self._fenced_write(lease, [], release=False)

    async def append(
        self,
        lease: TurnLease,
        messages: Sequence[Message],
        *,
        compaction: bool = False,
        snapshot: SnapshotRef | None = None,
    ) -> list[StoredMessage]:
        """Append messages of the lease's turn (fenced), refreshing its heartbeat.

        ``snapshot`` (stored content, see ``core.storage.snapshots.store_content``) becomes the
        sandbox state of the last message, in the same transaction.
        """
        return await self._fenced_write(
            lease, [(m, compaction) for m in messages], release=False, snapshot=snapshot
        )

    async def finish(
        self,
        lease: TurnLease,
        messages: Sequence[Message] = (),
        *,
        snapshot: SnapshotRef | None = None,
    ) -> list[StoredMessage]:
        """Append the turn's last messages (and their snapshot) and release the lock, atomically."""
        return await self._fenced_write(
            lease, [(m, False) for m in messages], release=True, snapshot=snapshot
        )

    async def rewrite(self, lease: TurnLease, message: Message) -> None:
        """Replace a stored message's content (same id, same place) behind the turn's fence:
        a tool part that waited for a person's decision takes its outcome. Only the message
        JSON changes; its position, snapshot and references stay."""
        row = q.message_row(lease.session_id, 0, message)
        async with self.db.write() as conn:
            if not await q.fence(
                conn, {"sid": lease.session_id, "token": lease.token}, release=False
            ):
                self._held.forget(lease)
                raise AgentSessionLockLost(
                    f"session {lease.session_id}: this turn's lock was taken over or released"
                )
            await conn.execute(
                update(q.MESSAGES)
                .where(
                    q.MESSAGES.c.session_id == lease.session_id,
                    q.MESSAGES.c.message_id == row["message_id"],
                )
                .values(message=row["message"])
            )
        self._held.confirm(lease)

    async def insert_checkpoint_before_tail(
        self, lease: TurnLease, checkpoint: Message
    ) -> StoredMessage:
        """Auto-compaction: put a checkpoint just before the turn's own user message.

        The user message was persisted with the claim (nothing the user said may be lost), so a
        checkpoint appended after it would hide it from the model. Instead the user message moves
        up one position and the checkpoint takes its place, in one fenced transaction; the user
        message keeps its id, so every surface still finds it.
        """
        tail_position = lease.next_position - 1
        row = q.message_row(lease.session_id, tail_position, checkpoint, compaction=True)
        async with self.db.write() as conn:
            fenced = await q.fence(
                conn, {"sid": lease.session_id, "token": lease.token}, release=False
            )
            if not fenced:
                self._held.forget(lease)
                raise AgentSessionLockLost(
                    f"session {lease.session_id}: this turn's lock was taken over or released"
                )
            for table in (q.SNAPSHOTS, q.MESSAGES):  # a snapshot keeps its message's position
                await conn.execute(
                    update(table)
                    .where(
                        table.c.session_id == lease.session_id, table.c.position == tail_position
                    )
                    .values(position=tail_position + 1)
                )
            await q.insert_messages(conn, [row])
        lease.next_position += 1
        self._held.confirm(lease)
        return StoredMessage(row["message_id"], tail_position, checkpoint, True)

    async def release(self, lease: TurnLease) -> None:
        """Release the lock; ``AgentSessionLockLost`` if it is no longer ours (nothing changes)."""
        await self._fenced_write(lease, [], release=True)

    async def _fenced_write(
        self,
        lease: TurnLease,
        messages: Sequence[tuple[Message, bool]],
        *,
        release: bool,
        snapshot: SnapshotRef | None = None,
    ) -> list[StoredMessage]:
        """The fence (token check, heartbeat or release) and the inserts, atomically.

        One message on PostgreSQL is one autocommitted statement (the fenced UPDATE in a CTE
        feeding the INSERT): one round trip instead of five, on the turn's hot path; no message
        (a heartbeat, a release) is the fence alone, autocommitted too. Otherwise the fence
        and the inserts run in one transaction.
        """
        rows = [
            q.message_row(lease.session_id, lease.next_position + i, message, compaction=c)
            for i, (message, c) in enumerate(messages)
        ]
        params = {"sid": lease.session_id, "token": lease.token}
        try:
            if self.db.dialect == "postgresql" and len(rows) <= 1 and snapshot is None:
                # The common cases (a turn's answer, its heartbeats): one round trip, no
                # BEGIN/COMMIT.
                async with self.db.autocommit() as conn:
                    if rows:
                        changed = await q.fenced_insert(conn, params, rows[0], release=release)
                    else:
                        changed = await q.fence(conn, params, release=release)
            else:
                async with self.db.write() as conn:
                    last = rows[-1]["message_id"] if rows else None
                    changed = await q.fence(conn, params, release=release, tail=last)
                    if changed and rows:
                        await q.insert_messages(conn, rows)
                        if snapshot is not None:
                            await attach_snapshot(
                                conn,
                                session_id=lease.session_id,
                                message_id=rows[-1]["message_id"],
                                ref=snapshot,
                            )
            if not changed:
                raise AgentSessionLockLost(
                    f"session {lease.session_id}: this turn's lock was taken over or released"
                )
        except AgentSessionLockLost:
            self._held.forget(lease)
            raise
        if release:
            self._held.forget(lease)
        else:
            self._held.confirm(lease)
        lease.next_position += len(rows)
        return [
            StoredMessage(r["message_id"], r["position"], r["message"], r["is_compaction_message"])
            for r in rows
        ]


class _HeldLeases:
    """The leases this process holds, with when the database last confirmed each one.

    Knowing it holds a session's lock, the process can refuse a second claim at once. The record
    is trusted only for 90% of the staleness window after the last confirmation (measured on the
    local monotonic clock, which runs at the database clock's pace), so it never says "busy"
    about a lock the database would already consider stale.
    """

    def __init__(self, staleness_seconds: float) -> None:
        self._trust = staleness_seconds * 0.9
        self._leases: dict[int, tuple[str, float]] = {}

    def confirm(self, lease: TurnLease) -> None:
        self._leases[lease.session_id] = (lease.token, time.monotonic())

    def forget(self, lease: TurnLease) -> None:
        held = self._leases.get(lease.session_id)
        if held is not None and held[0] == lease.token:
            del self._leases[lease.session_id]

    def refuse_if_live(self, session_id: int) -> None:
        held = self._leases.get(session_id)
        if held is not None and time.monotonic() - held[1] < self._trust:
            raise AgentSessionBusy(f"session {session_id} has a turn in progress")


class _KeyedLocks:
    """One ``asyncio.Lock`` per key while anyone waits on it; dropped when the last one leaves."""

    def __init__(self) -> None:
        self._locks: dict[int, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: int) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


def _leased(
    session_id: int, row: dict[str, Any], user_message: Message, got: tuple[str, int]
) -> TurnLease:
    """The lease of a claim made in one statement with its user message (``got``: the token
    and the message's position), on either of PostgreSQL's ways."""
    token, position = got
    message = StoredMessage(row["message_id"], position, user_message, False)
    return TurnLease(session_id, token, message, next_position=position + 1)
