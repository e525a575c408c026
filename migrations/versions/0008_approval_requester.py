"""Who asked for a tool call that waits for a decision (``tool_approvals.requested_by``).

In a shared Slack thread anyone may write, so the person whose message made the model ask for a
call is not necessarily the session's owner; the API's ``pendingApproval.requestedBy`` says who
it was. A nullable column: requests written before this revision keep NULL and are shown as the
owner's, as they were. Adding a nullable column rewrites nothing on either database (``ALTER
TABLE … ADD COLUMN``); ``downgrade`` rebuilds the small table on SQLite (batch mode).

Revision ID: 0008_approval_requester
Revises: 0007_budget_totals
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_approval_requester"
down_revision: str | None = "0007_budget_totals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tool_approvals") as batch_op:
        batch_op.add_column(sa.Column("requested_by", sa.String(length=255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tool_approvals") as batch_op:
        batch_op.drop_column("requested_by")
