"""The session's tail on its own row (``agent_sessions.tail_message_id``), so a claim and the
stale guard can be one statement.

The stale guard compared the client's ``last_message_id`` with the tail read from the
messages. As a statement of its own, after the claim in the claim's transaction, that is safe;
folded into the claim's statement it is not on PostgreSQL: a claim that waits on the session
row's lock while a release appends the answer re-checks the row's newest version
(EvalPlanQual), but a subquery on the messages keeps the statement's older snapshot and misses
the answer. On the session row itself the guard is re-checked with the rest of the claim.

Every statement that appends or removes a session's messages moves the column in the same
transaction (``core.storage.queries``). Existing sessions get their tail from their messages
here (one UPDATE over the sessions; an index seek on ``(session_id, position)`` each).

A replica of the previous version still running after the upgrade appends without moving the
column: until it stops, a claim on a session it wrote to is refused as stale against the
column's older tail (the refusal names that tail, and a client retrying with it is admitted),
and a client whose view that replica's turn moved on is not refused. Deploy this revision with
the previous release's replicas stopped, or while no turns run.

Revision ID: 0011_session_tail
Revises: 0010_reservation_per_turn
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_session_tail"
down_revision: str | None = "0010_reservation_per_turn"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agent_sessions") as batch_op:
        batch_op.add_column(sa.Column("tail_message_id", sa.String(length=36), nullable=True))
    op.execute(
        "UPDATE agent_sessions SET tail_message_id = ("
        " SELECT m.message_id FROM agent_session_messages m"
        " WHERE m.session_id = agent_sessions.id ORDER BY m.position DESC LIMIT 1)"
    )


def downgrade() -> None:
    with op.batch_alter_table("agent_sessions") as batch_op:
        batch_op.drop_column("tail_message_id")
