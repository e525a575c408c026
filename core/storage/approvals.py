"""Tool calls waiting for a person's decision: the statements of ``tool_approvals``.

A request's life (``state``, and ``reason`` once it ended)::

    pending ──> approved ──> running ──> ran        (a person approved; the call went out once)
       │           │            └─────> ran, may_have_run  (sent; its result never recorded)
       │           ├──> refused, over_budget        (the decider was over a budget: not run)
       │           ├──> superseded, moved_on        (the conversation moved on first: not run)
       │           └──> expired, decision_expired   (not carried out in time: not run)
       │    └─> denied ───────────────> declined    (a person declined; the model was told)
       ├──> expired, timeout       (nobody decided within APPROVAL_TIMEOUT_SECONDS)
       ├──> superseded, new_message | compacted | moved_on   (the conversation moved on)
       └──> rewound, rewound       (the message asking was taken out by a rewind)

Every request reaches one of the end states (``ENDED``) with a reason: a decision that can no
longer be carried out ends (``end``) instead of staying ``approved``, and a decision is carried
out within APPROVAL_TIMEOUT_SECONDS of being made or not at all (``start_running`` refuses an
older one; ``left_behind`` ends them), so no consent runs a call a day later by itself.

What the statements guarantee (each one conditional UPDATE, so on any replica and under any
number of clicks exactly one caller moves a request out of a state):

- ``decide``: a pending request that is not overdue becomes approved or denied by one person;
  a second decision, a late one, or one on a request that moved on changes nothing (None).
- ``start_running``: an approved request decided within the timeout is sent to its server by
  one turn only; a turn that finds it ``running`` (the one that sent it died) never sends it
  again.
- ``close`` / ``end``: a request leaves an open state for an end state, once.
- ``left_behind``: decided requests nobody carried out (the process that decided died before
  its turn); carrying one out is a turn like any other (claim, stale guard, ``start_running``),
  so of any number of processes picking one up the call still goes out at most once. Each pass
  takes the rows looked at longest ago and marks them looked at (``updated_at``), so rows that
  cannot be carried out yet never hide the others.

Overdue is measured on the database clock from ``requested_at``, so replicas agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any, Final, cast

from sqlalchemy import ColumnElement, Table, and_, bindparam, case, insert, or_, select, update

from core.storage.dialect import ago, db_now, update_returning
from core.storage.engine import Database
from core.storage.models import ToolApproval

APPROVALS: Final = cast(Table, ToolApproval.__table__)
A: Final = APPROVALS.c

APPROVED: Final = ("approved", "running", "ran")
DECLINED: Final = ("denied", "declined")
CLOSED: Final = ("expired", "superseded", "rewound")
ENDED: Final = ("ran", "declined", "refused", *CLOSED)
OPEN: Final = ("pending", "approved", "denied", "running")
# Why a request ended (``reason``).
TIMEOUT: Final = "timeout"  # nobody decided in time
DECISION_EXPIRED: Final = "decision_expired"  # decided, not carried out in time
NEW_MESSAGE: Final = "new_message"  # a new message moved the conversation on
COMPACTED: Final = "compacted"  # a compaction moved the conversation on
MOVED_ON: Final = "moved_on"  # no longer the conversation's last message when decided or run
OVER_BUDGET: Final = "over_budget"  # the decider was over a budget when it was to run
MAY_HAVE_RUN: Final = "may_have_run"  # sent to its server; the result was never recorded
REWOUND: Final = "rewound"
# The longest reason a person may give with a decision (characters): a sentence or two, shown
# with the decision and read by the model, never a document.
DECISION_REASON_MOST: Final = 500


@dataclass(frozen=True)
class ApprovalRecord:
    id: str
    session_id: int
    message_id: str
    tool_call_id: str
    tool_name: str
    server: str
    arguments: dict[str, Any]
    digest: str
    approvers: tuple[str, ...]
    state: str
    reason: str | None
    # The person whose message the model was answering when it asked; None on rows written
    # before it was kept (migration 0008) and for turns no person's message started.
    requested_by: str | None
    decided_by: str | None
    decision_reason: str | None  # what the decider said with it (None: nothing)
    decided_at: datetime | None
    card_ref: str | None
    card_state: str | None
    requested_at: datetime
    overdue: bool  # pending past the timeout (as the database clock said when it was read)

    @property
    def pending(self) -> bool:
        return self.state == "pending" and not self.overdue

    @property
    def approved(self) -> bool:
        return self.state in APPROVED

    @property
    def declined(self) -> bool:
        return self.state in DECLINED

    @property
    def carried_out(self) -> bool:
        return self.state in ("ran", "declined")


class Approvals:
    """The approval requests of every conversation; ``timeout_seconds`` is when they expire."""

    def __init__(self, db: Database, *, timeout_seconds: float) -> None:
        self.db = db
        self.timeout_seconds = float(timeout_seconds)

    def _columns(self) -> list[Any]:
        """A request's columns and whether it is overdue (built once: building the expression
        and its cache key on every read was most of a read's cost)."""
        return self._built

    @cached_property
    def _built(self) -> list[Any]:
        overdue = and_(A.state == "pending", A.requested_at < ago(self.timeout_seconds))
        return [*APPROVALS.c, overdue.label("overdue")]

    @cached_property
    def _by_id(self) -> Any:
        return select(*self._columns()).where(A.id == bindparam("approval_id"))

    async def request(
        self,
        *,
        session_id: int,
        message_id: str,
        tool_call_id: str,
        tool_name: str,
        server: str,
        arguments: dict[str, Any],
        digest: str,
        approvers: tuple[str, ...],
        requested_by: str | None = None,
    ) -> str:
        """Record a pending request; its id is what a surface's buttons carry.
        ``requested_by``: whose message made the model ask (in a shared thread, not always the
        session's owner), so a surface can say who asked."""
        approval_id = uuid.uuid4().hex
        async with self.db.write() as conn:
            await conn.execute(
                insert(APPROVALS).values(
                    id=approval_id,
                    session_id=session_id,
                    message_id=message_id,
                    tool_call_id=tool_call_id,
                    tool_name=tool_name,
                    server=server,
                    arguments=arguments,
                    digest=digest,
                    approvers=list(approvers),
                    requested_by=requested_by,
                    state="pending",
                )
            )
        return approval_id

    async def get(self, approval_id: str) -> ApprovalRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(self._by_id, {"approval_id": approval_id})).first()
        return None if row is None else _record(row)

    async def of_session(self, session_id: int, *, states: tuple[str, ...]) -> list[ApprovalRecord]:
        """The session's requests in these states, oldest first."""
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(*self._columns())
                .where(A.session_id == session_id, A.state.in_(states))
                .order_by(A.requested_at, A.id)
            )
            return [_record(r) for r in rows]

    async def pending_among(self, session_ids: list[int]) -> list[ApprovalRecord]:
        """The pending requests of these sessions, oldest first (``of_session`` for many)."""
        if not session_ids:
            return []
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(*self._columns())
                .where(A.session_id.in_(session_ids), A.state == "pending")
                .order_by(A.requested_at, A.id)
            )
            return [_record(r) for r in rows]

    async def of_message(self, message_id: str) -> list[ApprovalRecord]:
        async with self.db.read() as conn:
            rows = await conn.execute(select(*self._columns()).where(A.message_id == message_id))
            return [_record(r) for r in rows]

    async def decide(
        self, approval_id: str, *, approve: bool, by: str, reason: str | None = None
    ) -> ApprovalRecord | None:
        """One person's decision on a pending request that is not overdue; None otherwise.
        ``reason``: what they said with it, kept with the decision in the same write (so it
        is never another decider's); longer than ``DECISION_REASON_MOST`` is a ValueError and
        nothing is written (a surface refuses it before)."""
        if reason is not None and len(reason) > DECISION_REASON_MOST:
            raise ValueError(f"a decision's reason is at most {DECISION_REASON_MOST} characters")
        return await self._move(
            and_(
                A.id == approval_id,
                A.state == "pending",
                A.requested_at >= ago(self.timeout_seconds),
            ),
            {
                "state": "approved" if approve else "denied",
                "decided_by": by,
                "decision_reason": reason or None,
                "decided_at": db_now(),
            },
        )

    async def close(
        self, approval_id: str, state: str, reason: str | None = None
    ) -> ApprovalRecord | None:
        """A pending request ends undecided: ``superseded``, ``rewound`` or ``expired`` (only
        once overdue). An approved one not yet carried out can be superseded too: a new message
        came first, so the call never runs."""
        assert state in CLOSED
        before = ("pending", "approved") if state == "superseded" else ("pending",)
        condition = and_(A.id == approval_id, A.state.in_(before))
        if state == "expired":
            condition = and_(condition, A.requested_at < ago(self.timeout_seconds))
        default = {"expired": TIMEOUT, "rewound": REWOUND, "superseded": NEW_MESSAGE}[state]
        return await self._move(condition, {"state": state, "reason": reason or default})

    async def end(
        self, approval_id: str, *, before: tuple[str, ...], state: str, reason: str | None
    ) -> ApprovalRecord | None:
        """A request in one of ``before`` ends as ``state`` for ``reason``; None when it had
        moved on (someone else ended it first)."""
        assert state in ENDED
        return await self._move(
            and_(A.id == approval_id, A.state.in_(before)), {"state": state, "reason": reason}
        )

    async def end_open(self, session_id: int, reason: str) -> int:
        """The conversation moved on (``reason``: a compaction): every request of the session
        still open ends, as a new message would end it (pending or approved: superseded, the
        call never runs; denied: declined; running: ran, it may have)."""
        moved = 0
        for before, after, why in (
            (("pending", "approved"), "superseded", reason),
            (("denied",), "declined", None),
            (("running",), "ran", MAY_HAVE_RUN),
        ):
            async with self.db.write() as conn:
                result = await conn.execute(
                    update(APPROVALS)
                    .where(A.session_id == session_id, A.state.in_(before))
                    .values(state=after, reason=why, updated_at=db_now())
                )
            moved += result.rowcount or 0
        return moved

    async def start_running(self, approval_id: str) -> bool:
        """An approved call is about to go to its server: True for exactly one caller, and only
        within APPROVAL_TIMEOUT_SECONDS of the decision (an older consent runs nothing)."""
        moved = await self._move(
            and_(
                A.id == approval_id,
                A.state == "approved",
                A.decided_at >= ago(self.timeout_seconds),
            ),
            {"state": "running"},
        )
        return moved is not None

    async def carried_out(self, approval_id: str) -> ApprovalRecord | None:
        """The turn that carried the decision out finished: ``ran`` or ``declined``."""
        after = case((A.state == "running", "ran"), else_="declined")
        return await self._move(
            and_(A.id == approval_id, A.state.in_(("running", "denied"))),
            {"state": after, "reason": None},
        )

    async def set_card(self, approval_id: str, card_ref: str) -> None:
        """Where a surface showed the request (to show its outcome there later)."""
        async with self.db.write() as conn:
            await conn.execute(
                update(APPROVALS)
                .where(A.id == approval_id)
                .values(card_ref=card_ref, card_state="pending")
            )

    async def cards_behind(self, limit: int = 100) -> list[ApprovalRecord]:
        """Requests whose card shows a state they have left (decided elsewhere, carried out,
        superseded, rewound), and pending ones past the timeout (expired first)."""
        async with self.db.write() as conn:
            await conn.execute(
                update(APPROVALS)
                .where(A.state == "pending", A.requested_at < ago(self.timeout_seconds))
                .values(state="expired", reason=TIMEOUT, updated_at=db_now())
            )
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(*self._columns())
                .where(A.card_ref.is_not(None), A.card_state != A.state)
                .order_by(A.updated_at)
                .limit(limit)
            )
            return [_record(r) for r in rows]

    async def card_shown(self, approval_id: str, shown: str, now: str) -> bool:
        """The card moves from showing ``shown`` to ``now``; True for one caller (one replica
        updates a card for each change)."""
        async with self.db.write() as conn:
            result = await conn.execute(
                update(APPROVALS)
                .where(A.id == approval_id, A.card_state == shown)
                .values(card_state=now)
            )
        return bool(result.rowcount)

    async def left_behind(
        self, older_than_seconds: float, *, session_id: int | None = None, limit: int = 20
    ) -> list[ApprovalRecord]:
        """Requests decided over ``older_than_seconds`` ago (the database clock) and not carried
        out, the ones looked at longest ago first (``session_id``: of that session only). The
        rows returned are marked looked at (``updated_at``), so they go to the back of the line
        and the next pass (here or on another replica) takes the next ones: a batch of rows
        nobody can carry out yet never hides the rest, each row comes up at least once every
        ``ceil(rows / limit)`` passes. Approved
        decisions older than the timeout end first (``decision_expired``): they never run."""
        expired = and_(A.state == "approved", A.decided_at < ago(self.timeout_seconds))
        condition = and_(
            A.state.in_(("approved", "running", "denied")),
            A.decided_at < ago(older_than_seconds),
        )
        if session_id is not None:
            expired = and_(expired, A.session_id == session_id)
            condition = and_(condition, A.session_id == session_id)
        # A read first: most rounds find nothing, and must not take a write transaction.
        async with self.db.read() as conn:
            seen = await conn.scalar(select(A.id).where(or_(condition, expired)).limit(1))
        if seen is None:
            return []
        oldest = (
            select(A.id)
            .where(condition)
            .order_by(A.updated_at, A.id)
            .limit(limit)
            .scalar_subquery()
        )
        async with self.db.write() as conn:
            await conn.execute(
                update(APPROVALS)
                .where(expired)
                .values(state="expired", reason=DECISION_EXPIRED, updated_at=db_now())
            )
            rows = await update_returning(
                conn,
                APPROVALS,
                and_(condition, A.id.in_(oldest)),
                {"updated_at": db_now()},
                self._columns(),
            )
        found = [_record(r) for r in rows]
        return sorted(found, key=lambda r: (r.decided_at or r.requested_at, r.id))

    async def overdue(self, limit: int = 100) -> list[ApprovalRecord]:
        """Pending requests past the timeout, oldest first (to expire and say so)."""
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(*self._columns())
                .where(A.state == "pending", A.requested_at < ago(self.timeout_seconds))
                .order_by(A.requested_at)
                .limit(limit)
            )
            return [_record(r) for r in rows]

    async def _move(
        self, condition: ColumnElement[bool], values: dict[str, Any]
    ) -> ApprovalRecord | None:
        values = {**values, "updated_at": db_now()}
        async with self.db.write() as conn:  # the row as moved, in the same statement
            rows = await update_returning(conn, APPROVALS, condition, values, self._columns())
        return _record(rows[0]) if rows else None


def _record(row: Any) -> ApprovalRecord:
    return ApprovalRecord(
        id=row.id,
        session_id=int(row.session_id),
        message_id=row.message_id,
        tool_call_id=row.tool_call_id,
        tool_name=row.tool_name,
        server=row.server,
        arguments=dict(row.arguments),
        digest=row.digest,
        approvers=tuple(row.approvers or ()),
        state=row.state,
        reason=row.reason,
        requested_by=row.requested_by,
        decided_by=row.decided_by,
        decision_reason=row.decision_reason,
        decided_at=row.decided_at,
        card_ref=row.card_ref,
        card_state=row.card_state,
        requested_at=row.requested_at,
        overdue=bool(row.overdue),
    )
