"""Delivery records: every received message from before its acknowledgement to its answer;
``agent_sessions.stop_token``, a stop asked of a running turn (a stop button); and
``surface_viewing``, what a person is looking at beside the agent; ``surface_stash``, state
between a posted message and a click on it; ``message_feedback``, votes on answers.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

``deliveries`` replaces ``processed_events`` (which only said "taken", so a message taken by a
replica that then died was lost) and ``waiting_drafts`` (a waiting message is a delivery record
in state ``waiting``, ``offered`` or ``stale``). See ``core.deliveries``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _now() -> sa.TextClause:
    """The database clock with sub-second precision, as ``core.db.db_now`` renders it."""
    if op.get_bind().dialect.name == "sqlite":
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f000', 'now'))")
    return sa.text("statement_timestamp()")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "deliveries",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("event_key", sa.String(length=255), nullable=False),
        sa.Column("thread_key", sa.String(length=255), nullable=False),
        sa.Column("session_id", _id(), nullable=True),
        sa.Column("author", sa.String(length=255), nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("context", _json(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("wait_reason", sa.String(length=20), nullable=True),
        sa.Column("owner", sa.String(length=36), nullable=True),
        sa.Column("lease_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("takeovers", sa.Integer(), server_default="0", nullable=False),
        sa.Column("waiting_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reply_ref", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_deliveries_session_id_agent_sessions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deliveries")),
        sa.UniqueConstraint("surface", "event_key", name=op.f("uq_deliveries_surface_event_key")),
    )
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_deliveries_surface_thread_key_id"),
            ["surface", "thread_key", "id"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_deliveries_state_lease_at"), ["state", "lease_at"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_deliveries_owner"), ["owner"], unique=False)
        batch_op.create_index(batch_op.f("ix_deliveries_updated_at"), ["updated_at"], unique=False)

    with op.batch_alter_table("agent_sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("stop_token", sa.String(length=36), nullable=True))

    op.create_table(
        "message_feedback",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("voter", sa.String(length=255), nullable=False),
        sa.Column("value", sa.String(length=10), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.CheckConstraint("value IN ('good', 'bad')", name=op.f("ck_message_feedback_value")),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["agent_session_messages.message_id"],
            name=op.f("fk_message_feedback_message_id_agent_session_messages"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_message_feedback")),
        sa.UniqueConstraint(
            "message_id", "voter", name=op.f("uq_message_feedback_message_id_voter")
        ),
    )

    op.create_table(
        "surface_stash",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("value", _json(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_surface_stash")),
    )
    with op.batch_alter_table("surface_stash", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_surface_stash_created_at"), ["created_at"], unique=False
        )

    op.create_table(
        "surface_viewing",
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("person", sa.String(length=255), nullable=False),
        sa.Column("context", _json(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("surface", "person", name=op.f("pk_surface_viewing")),
    )

    with op.batch_alter_table("waiting_drafts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_waiting_drafts_session_id_state_created_at"))
    op.drop_table("waiting_drafts")
    with op.batch_alter_table("processed_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_processed_events_created_at"))
    op.drop_table("processed_events")


def downgrade() -> None:
    op.drop_table("message_feedback")
    op.drop_table("surface_viewing")
    with op.batch_alter_table("surface_stash", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_surface_stash_created_at"))
    op.drop_table("surface_stash")
    with op.batch_alter_table("agent_sessions", schema=None) as batch_op:
        batch_op.drop_column("stop_token")
    op.create_table(
        "processed_events",
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("event_key", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("surface", "event_key", name=op.f("pk_processed_events")),
    )
    with op.batch_alter_table("processed_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_processed_events_created_at"), ["created_at"], unique=False
        )
    op.create_table(
        "waiting_drafts",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("author", sa.String(length=255), nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("reason", sa.String(length=20), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("context", _json(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_waiting_drafts_session_id_agent_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_waiting_drafts")),
    )
    with op.batch_alter_table("waiting_drafts", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_waiting_drafts_session_id_state_created_at"),
            ["session_id", "state", "created_at"],
            unique=False,
        )
    with op.batch_alter_table("deliveries", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_deliveries_updated_at"))
        batch_op.drop_index(batch_op.f("ix_deliveries_owner"))
        batch_op.drop_index(batch_op.f("ix_deliveries_state_lease_at"))
        batch_op.drop_index(batch_op.f("ix_deliveries_surface_thread_key_id"))
    op.drop_table("deliveries")
