"""The reason a person gave with a decision on a tool call (``tool_approvals.decision_reason``).

``POST …/tool_approvals {"approvalId", "approved", "reason"}`` accepted a reason and dropped it;
it is now kept beside ``decided_by`` (at most 500 characters, ``core.storage.approvals``), shown
with the decision, and a declined call's model reads it. A nullable column: decisions made
before this revision have none. ``ALTER TABLE … ADD COLUMN`` on both databases; ``downgrade``
rebuilds the small table on SQLite (batch mode).

Revision ID: 0009_decision_reason
Revises: 0008_approval_requester
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_decision_reason"
down_revision: str | None = "0008_approval_requester"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tool_approvals") as batch_op:
        batch_op.add_column(sa.Column("decision_reason", sa.String(length=500), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tool_approvals") as batch_op:
        batch_op.drop_column("decision_reason")
