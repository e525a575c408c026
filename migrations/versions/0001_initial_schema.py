"""The initial schema, in one revision: the data model (docs/design.md) and the surfaces' state.

Revision ID: 0001
Revises:
Create Date: 2026-12-01

Nothing was released before this revision, so the history that led to it (four revisions, one
of which dropped and recreated tables an earlier one made) was folded into it.
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
    """The database clock with sub-second precision, as ``core.storage.engine.db_now`` renders
    it."""
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
        "custom_providers",
        sa.Column(
            "id",
            _id(),
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
        "system_settings",
        sa.Column("key", sa.String(length=100), nullable=False),
        sa.Column(
            "value",
            _json(),
            nullable=False,
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_system_settings")),
    )
    op.create_table(
        "users",
        sa.Column(
            "id",
            _id(),
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
            _id(),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("project_session_id", sa.String(length=255), nullable=False),
        sa.Column("project_name", sa.String(length=100), nullable=False),
        sa.Column("user_id", _id(), nullable=True),
        sa.Column("title", sa.String(length=255), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lock_token", sa.String(length=36), nullable=True),
        sa.Column("stop_token", sa.String(length=36), nullable=True),
        sa.Column("model_provider", sa.String(length=100), nullable=True),
        sa.Column("model_name", sa.String(length=255), nullable=True),
        sa.Column(
            "custom_provider_id",
            _id(),
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
            _id(),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column(
            "message",
            _json(),
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
        "snapshot_contents",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("codec", sa.String(length=20), nullable=False),
        sa.Column("base_id", _id(), nullable=True),
        sa.Column("raw_size", _id(), nullable=False),
        sa.Column("stored_size", _id(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.CheckConstraint(
            "(codec = 'zstd-delta' AND base_id IS NOT NULL)"
            " OR (codec <> 'zstd-delta' AND base_id IS NULL)",
            name=op.f("ck_snapshot_contents_delta_has_base"),
        ),
        sa.ForeignKeyConstraint(
            ["base_id"],
            ["snapshot_contents.id"],
            name=op.f("fk_snapshot_contents_base_id_snapshot_contents"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshot_contents")),
        sa.UniqueConstraint("digest", name=op.f("uq_snapshot_contents_digest")),
    )
    with op.batch_alter_table("snapshot_contents", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_snapshot_contents_base_id"), ["base_id"], unique=False)

    op.create_table(
        "snapshot_sets",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_snapshot_sets")),
        sa.UniqueConstraint("digest", name=op.f("uq_snapshot_sets_digest")),
    )

    op.create_table(
        "snapshot_set_members",
        sa.Column("set_id", _id(), nullable=False),
        sa.Column("content_id", _id(), nullable=False),
        sa.ForeignKeyConstraint(
            ["content_id"],
            ["snapshot_contents.id"],
            name=op.f("fk_snapshot_set_members_content_id_snapshot_contents"),
        ),
        sa.ForeignKeyConstraint(
            ["set_id"],
            ["snapshot_sets.id"],
            name=op.f("fk_snapshot_set_members_set_id_snapshot_sets"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("set_id", "content_id", name=op.f("pk_snapshot_set_members")),
    )
    with op.batch_alter_table("snapshot_set_members", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_snapshot_set_members_content_id"), ["content_id"], unique=False
        )

    op.create_table(
        "agent_session_snapshots",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("content_digest", sa.String(length=64), nullable=False),
        sa.Column("base_set_id", _id(), nullable=False),
        sa.Column("delta_set_id", _id(), nullable=True),
        sa.Column("raw_size", _id(), nullable=False),
        sa.Column("stored_size", _id(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["base_set_id"],
            ["snapshot_sets.id"],
            name=op.f("fk_agent_session_snapshots_base_set_id_snapshot_sets"),
        ),
        sa.ForeignKeyConstraint(
            ["delta_set_id"],
            ["snapshot_sets.id"],
            name=op.f("fk_agent_session_snapshots_delta_set_id_snapshot_sets"),
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
        sa.UniqueConstraint(
            "session_id",
            "position",
            name=op.f("uq_agent_session_snapshots_session_id_position"),
        ),
    )
    with op.batch_alter_table("agent_session_snapshots", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_base_set_id"), ["base_set_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_delta_set_id"), ["delta_set_id"], unique=False
        )

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


def downgrade() -> None:
    # Indexes go with their tables; children before parents.
    op.drop_table("surface_viewing")
    op.drop_table("surface_stash")
    op.drop_table("message_feedback")
    op.drop_table("deliveries")
    op.drop_table("surface_message_refs")
    op.drop_table("surface_threads")
    op.drop_table("agent_session_snapshots")
    op.drop_table("snapshot_set_members")
    op.drop_table("snapshot_sets")
    op.drop_table("snapshot_contents")
    op.drop_table("agent_session_messages")
    op.drop_table("agent_sessions")
    op.drop_table("users")
    op.drop_table("system_settings")
    op.drop_table("custom_providers")
