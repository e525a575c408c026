"""Tool calls waiting for a person's decision: the statements of ``tool_approvals``.

A request's life (``state``)::

    pending ──> approved ──> running ──> ran        (a person approved; the call went out once)
       │    └─> denied ───────────────> declined    (a person declined; the model was told)
       │       (approved or denied, not carried out yet, and a new message came: superseded)
       ├──> expired       (nobody decided within APPROVAL_TIMEOUT_SECONDS)
       ├──> superseded    (a new message in the conversation moved on)
       └──> rewound       (the message asking was taken out by a rewind)

What the statements guarantee (each one conditional UPDATE, so on any replica and under any
number of clicks exactly one caller moves a request out of a state):

- ``decide``: a pending request that is not overdue becomes approved or denied by one person;
  a second decision, a late one, or one on a request that moved on changes nothing (None).
- ``start_running``: an approved request is sent to its server by one turn only; a turn that
  finds it ``running`` (the one that sent it died) never sends it again.
- ``close``: a pending request is superseded, rewound or expired, once.
- ``left_behind``: decided requests nobody carried out (the process that decided died before
  its turn); carrying one out is a turn like any other (claim, stale guard, ``start_running``),
  so of any number of processes picking one up the call still goes out at most once.

Overdue is measured on the database clock from ``requested_at``, so replicas agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import ColumnElement, Table, and_, insert, select, update

from core.storage.dialect import ago, db_now, update_returning
from core.storage.engine import Database
from core.storage.models import ToolApproval

APPROVALS: Final = cast(Table, ToolApproval.__table__)
A: Final = APPROVALS.c

APPROVED: Final = ("approved", "running", "ran")
DECLINED: Final = ("denied", "declined")
CLOSED: Final = ("expired", "superseded", "rewound")


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
    decided_by: str | None
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
        overdue = and_(A.state == "pending", A.requested_at < ago(self.timeout_seconds))
        return [*APPROVALS.c, overdue.label("overdue")]

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
    ) -> str:
        """Record a pending request; its id is what a surface's buttons carry."""
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
                    state="pending",
                )
            )
        return approval_id

    async def get(self, approval_id: str) -> ApprovalRecord | None:
        async with self.db.read() as conn:
            row = (await conn.execute(select(*self._columns()).where(A.id == approval_id))).first()
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

    async def decide(self, approval_id: str, *, approve: bool, by: str) -> ApprovalRecord | None:
        """One person's decision on a pending request that is not overdue; None otherwise."""
        return await self._move(
            and_(
                A.id == approval_id,
                A.state == "pending",
                A.requested_at >= ago(self.timeout_seconds),
            ),
            {
                "state": "approved" if approve else "denied",
                "decided_by": by,
                "decided_at": db_now(),
            },
        )

    async def close(self, approval_id: str, state: str) -> ApprovalRecord | None:
        """A pending request ends undecided: ``superseded``, ``rewound`` or ``expired`` (only
        once overdue). A decided one not yet carried out can be superseded too: a new message
        came first, so the call never runs."""
        assert state in CLOSED
        before = ("pending", "approved", "denied") if state == "superseded" else ("pending",)
        condition = and_(A.id == approval_id, A.state.in_(before))
        if state == "expired":
            condition = and_(condition, A.requested_at < ago(self.timeout_seconds))
        return await self._move(condition, {"state": state})

    async def start_running(self, approval_id: str) -> bool:
        """An approved call is about to go to its server: True for exactly one caller."""
        moved = await self._move(
            and_(A.id == approval_id, A.state == "approved"), {"state": "running"}
        )
        return moved is not None

    async def carried_out(self, approval_id: str) -> ApprovalRecord | None:
        """The turn that carried the decision out finished: ``ran`` or ``declined``."""
        for before, after in (("running", "ran"), ("denied", "declined")):
            moved = await self._move(and_(A.id == approval_id, A.state == before), {"state": after})
            if moved is not None:
                return moved
        return None

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
                .values(state="expired", updated_at=db_now())
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
        out, oldest decision first (``session_id``: of that session only)."""
        condition = and_(
            A.state.in_(("approved", "running", "denied")),
            A.decided_at < ago(older_than_seconds),
        )
        if session_id is not None:
            condition = and_(condition, A.session_id == session_id)
        async with self.db.read() as conn:
            rows = await conn.execute(
                select(*self._columns()).where(condition).order_by(A.decided_at, A.id).limit(limit)
            )
            return [_record(r) for r in rows]

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
        async with self.db.write() as conn:
            rows = await update_returning(conn, APPROVALS, condition, values, [A.id])
        if not rows:
            return None
        return await self.get(str(rows[0].id))


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
        decided_by=row.decided_by,
        decided_at=row.decided_at,
        card_ref=row.card_ref,
        card_state=row.card_state,
        requested_at=row.requested_at,
        overdue=bool(row.overdue),
    )
