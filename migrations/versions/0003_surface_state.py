"""Surface state: threads, message refs, processed events and waiting drafts.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

What a chat surface (Slack) remembers beside the sessions, keyed by a surface name so the core
stays surface-neutral (``core.surface_state``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
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


def _session_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["session_id"],
        ["agent_sessions.id"],
        name=op.f(f"fk_{table}_session_id_agent_sessions"),
        ondelete="CASCADE",
    )


def upgrade() -> None:
    op.create_table(
        "surface_threads",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("thread_key", sa.String(length=255), nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("last_shown_message_id", sa.String(length=36), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        _session_fk("surface_threads"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_surface_threads")),
        sa.UniqueConstraint(
            "surface", "thread_key", name=op.f("uq_surface_threads_surface_thread_key")
        ),
    )
    with op.batch_alter_table("surface_threads", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_surface_threads_session_id"), ["session_id"], unique=False
        )

    op.create_table(
        "surface_message_refs",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("surface", sa.String(length=50), nullable=False),
        sa.Column("ref_key", sa.String(length=255), nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        _session_fk("surface_message_refs"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_surface_message_refs")),
        sa.UniqueConstraint(
            "surface", "ref_key", name=op.f("uq_surface_message_refs_surface_ref_key")
        ),
    )
    with op.batch_alter_table("surface_message_refs", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_surface_message_refs_message_id"), ["message_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_surface_message_refs_session_id"), ["session_id"], unique=False
        )

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
        _session_fk("waiting_drafts"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_waiting_drafts")),
    )
    with op.batch_alter_table("waiting_drafts", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_waiting_drafts_session_id_state_created_at"),
            ["session_id", "state", "created_at"],
            unique=False,
        )


def downgrade() -> None:
    with op.batch_alter_table("waiting_drafts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_waiting_drafts_session_id_state_created_at"))
    op.drop_table("waiting_drafts")
    with op.batch_alter_table("processed_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_processed_events_created_at"))
    op.drop_table("processed_events")
    with op.batch_alter_table("surface_message_refs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_surface_message_refs_session_id"))
        batch_op.drop_index(batch_op.f("ix_surface_message_refs_message_id"))
    op.drop_table("surface_message_refs")
    with op.batch_alter_table("surface_threads", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_surface_threads_session_id"))
    op.drop_table("surface_threads")
