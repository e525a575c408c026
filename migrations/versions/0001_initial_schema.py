"""Initial schema: users, custom providers, agent sessions, messages, snapshots, settings.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _now() -> sa.TextClause:
    """The database clock with sub-second precision, as ``core.db.db_now`` renders it."""
    if op.get_bind().dialect.name == "sqlite":
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f000', 'now'))")
    return sa.text("statement_timestamp()")


def upgrade() -> None:
    op.create_table(
        "custom_providers",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("base_url", sa.String(length=2048), nullable=False),
        sa.Column("api_key_env", sa.String(length=255), nullable=False),
        sa.Column("default_model", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.CheckConstraint(
            "kind IN ('openai', 'anthropic')", name=op.f("ck_custom_providers_kind")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_custom_providers")),
        sa.UniqueConstraint("name", name=op.f("uq_custom_providers_name")),
    )
    op.create_table(
        "snapshot_contents",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("codec", sa.String(length=20), nullable=False),
        sa.Column("raw_size", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "stored_size", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_snapshot_contents")),
    )
    op.create_table(
        "system_settings",
        sa.Column("key", sa.String(length=100), nullable=False),
        sa.Column(
            "value",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_system_settings")),
    )
    op.create_table(
        "users",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("external_id", sa.String(length=255), nullable=False),
        sa.Column("display_name", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("external_id", name=op.f("uq_users_external_id")),
    )
    op.create_table(
        "agent_sessions",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("project_session_id", sa.String(length=255), nullable=False),
        sa.Column("project_name", sa.String(length=100), nullable=False),
        sa.Column("user_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("title", sa.String(length=255), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lock_token", sa.String(length=36), nullable=True),
        sa.Column("model_provider", sa.String(length=100), nullable=True),
        sa.Column("model_name", sa.String(length=255), nullable=True),
        sa.Column(
            "custom_provider_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=True,
        ),
        sa.Column("builtin_provider", sa.String(length=100), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["custom_provider_id"],
            ["custom_providers.id"],
            name=op.f("fk_agent_sessions_custom_provider_id_custom_providers"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["user_id"],
            ["users.id"],
            name=op.f("fk_agent_sessions_user_id_users"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent_sessions")),
        sa.UniqueConstraint(
            "project_name",
            "project_session_id",
            name=op.f("uq_agent_sessions_project_name_project_session_id"),
        ),
    )
    with op.batch_alter_table("agent_sessions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_agent_sessions_expires_at"), ["expires_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_agent_sessions_updated_at"), ["updated_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_agent_sessions_user_id_updated_at"),
            ["user_id", "updated_at"],
            unique=False,
        )

    op.create_table(
        "agent_session_messages",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column(
            "message",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("is_compaction_message", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_agent_session_messages_session_id_agent_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent_session_messages")),
        sa.UniqueConstraint("message_id", name=op.f("uq_agent_session_messages_message_id")),
        sa.UniqueConstraint(
            "session_id", "position", name=op.f("uq_agent_session_messages_session_id_position")
        ),
    )
    with op.batch_alter_table("agent_session_messages", schema=None) as batch_op:
        batch_op.create_index(
            "ix_agent_session_messages_checkpoints",
            ["session_id", "position"],
            unique=False,
            postgresql_where=sa.text("is_compaction_message = true"),
            sqlite_where=sa.text("is_compaction_message = 1"),
        )

    op.create_table(
        "agent_session_snapshots",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column(
            "session_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("content_digest", sa.String(length=64), nullable=False),
        sa.Column("raw_size", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "stored_size", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["content_digest"],
            ["snapshot_contents.digest"],
            name=op.f("fk_agent_session_snapshots_content_digest_snapshot_contents"),
        ),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["agent_session_messages.message_id"],
            name=op.f("fk_agent_session_snapshots_message_id_agent_session_messages"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_agent_session_snapshots_session_id_agent_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent_session_snapshots")),
        sa.UniqueConstraint("message_id", name=op.f("uq_agent_session_snapshots_message_id")),
    )
    with op.batch_alter_table("agent_session_snapshots", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_content_digest"),
            ["content_digest"],
            unique=False,
        )
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_session_id"), ["session_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("agent_session_snapshots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_session_id"))
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_content_digest"))

    op.drop_table("agent_session_snapshots")
    with op.batch_alter_table("agent_session_messages", schema=None) as batch_op:
        batch_op.drop_index("ix_agent_session_messages_checkpoints")

    op.drop_table("agent_session_messages")
    with op.batch_alter_table("agent_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_agent_sessions_user_id_updated_at"))
        batch_op.drop_index(batch_op.f("ix_agent_sessions_updated_at"))
        batch_op.drop_index(batch_op.f("ix_agent_sessions_expires_at"))

    op.drop_table("agent_sessions")
    op.drop_table("users")
    op.drop_table("system_settings")
    op.drop_table("snapshot_contents")
    op.drop_table("custom_providers")
