"""Usage: the ledger of model requests, the reservations running turns hold against budgets,
and a custom provider's own prices.

Revision ID: 0002_usage
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_usage"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _now() -> sa.TextClause:
    if op.get_bind().dialect.name == "sqlite":
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f000', 'now'))")
    return sa.text("statement_timestamp()")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("custom_providers") as batch_op:
        for column in ("input", "output", "cached"):
            batch_op.add_column(
                sa.Column(f"{column}_usd_per_million", sa.String(length=40), nullable=True)
            )
    op.create_table(
        "usage_requests",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("session_id", _id(), nullable=True),
        sa.Column("message_id", sa.String(length=36), nullable=True),
        sa.Column("user_key", sa.String(length=255), nullable=True),
        sa.Column("workspace", sa.String(length=255), nullable=True),
        sa.Column("surface", sa.String(length=50), nullable=True),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("provider", sa.String(length=100), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("input_tokens", _id(), nullable=True),
        sa.Column("output_tokens", _id(), nullable=True),
        sa.Column("cached_tokens", _id(), nullable=True),
        sa.Column("cache_write_tokens", _id(), nullable=True),
        sa.Column("counted_tokens", _id(), nullable=False),
        sa.Column("estimated", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("counts_estimated", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("cost_nanousd", _id(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_requests")),
    )
    op.create_index(op.f("ix_usage_requests_created_at"), "usage_requests", ["created_at"])
    op.create_index(
        op.f("ix_usage_requests_user_key_created_at"), "usage_requests", ["user_key", "created_at"]
    )
    op.create_index(
        op.f("ix_usage_requests_workspace_created_at"),
        "usage_requests",
        ["workspace", "created_at"],
    )
    op.create_table(
        "usage_reservations",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("lock_token", sa.String(length=36), nullable=False),
        sa.Column("account", sa.String(length=300), nullable=False),
        sa.Column("unit", sa.String(length=10), nullable=False),
        sa.Column("amount", _id(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_usage_reservations_session_id_agent_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_reservations")),
    )
    op.create_index(
        op.f("ix_usage_reservations_account_unit"), "usage_reservations", ["account", "unit"]
    )
    op.create_index(op.f("ix_usage_reservations_session_id"), "usage_reservations", ["session_id"])


def downgrade() -> None:
    op.drop_table("usage_reservations")
    op.drop_table("usage_requests")
    with op.batch_alter_table("custom_providers") as batch_op:
        for column in ("input", "output", "cached"):
            batch_op.drop_column(f"{column}_usd_per_million")
