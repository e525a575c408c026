"""Tool calls that wait for a person's decision (``tool_approvals``).

Revision ID: 0003_approvals
Revises: 0002_usage
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003_approvals"
down_revision: str | None = "0002_usage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _now() -> sa.TextClause:
    if op.get_bind().dialect.name == "sqlite":
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f000', 'now'))")
    return sa.text("statement_timestamp()")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "tool_approvals",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("tool_call_id", sa.String(length=255), nullable=False),
        sa.Column("tool_name", sa.String(length=255), nullable=False),
        sa.Column("server", sa.String(length=64), nullable=False),
        sa.Column("arguments", _json(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("approvers", _json(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("decided_by", sa.String(length=255), nullable=True),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("card_ref", sa.String(length=255), nullable=True),
        sa.Column("card_state", sa.String(length=20), nullable=True),
        sa.Column(
            "requested_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_tool_approvals_session_id_agent_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tool_approvals")),
    )
    with op.batch_alter_table("tool_approvals", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_tool_approvals_session_id_state"), ["session_id", "state"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_tool_approvals_state_requested_at"),
            ["state", "requested_at"],
            unique=False,
        )


def downgrade() -> None:
    op.drop_table("tool_approvals")
