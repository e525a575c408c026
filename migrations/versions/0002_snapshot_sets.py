"""Snapshots as sets of content-addressed bashkit objects, with delta-encoded content.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

``snapshot_contents`` gets an integer id (set memberships refer to it: 16 bytes a reference
instead of two 64-character digests) and a ``base_id`` for zstd deltas; ``snapshot_sets`` and
``snapshot_set_members`` are new; a snapshot refers to a base set and a delta set instead of
one blob. The two snapshot tables of 0001 are recreated rather than altered: no release wrote
them (the sandbox arrives with this revision), and their one-blob rows have no meaning in the
new layout. Downgrading drops every snapshot for the same reason, in the other direction.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _now() -> sa.TextClause:
    """The database clock with sub-second precision, as ``core.db.db_now`` renders it."""
    if op.get_bind().dialect.name == "sqlite":
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f000', 'now'))")
    return sa.text("statement_timestamp()")


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _drop_0001_snapshot_tables() -> None:
    with op.batch_alter_table("agent_session_snapshots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_session_id"))
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_content_digest"))
    op.drop_table("agent_session_snapshots")
    op.drop_table("snapshot_contents")


def upgrade() -> None:
    _drop_0001_snapshot_tables()

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
    )
    with op.batch_alter_table("agent_session_snapshots", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_base_set_id"), ["base_set_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_delta_set_id"), ["delta_set_id"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_agent_session_snapshots_session_id"), ["session_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("agent_session_snapshots", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_session_id"))
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_delta_set_id"))
        batch_op.drop_index(batch_op.f("ix_agent_session_snapshots_base_set_id"))
    op.drop_table("agent_session_snapshots")
    with op.batch_alter_table("snapshot_set_members", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_snapshot_set_members_content_id"))
    op.drop_table("snapshot_set_members")
    op.drop_table("snapshot_sets")
    with op.batch_alter_table("snapshot_contents", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_snapshot_contents_base_id"))
    op.drop_table("snapshot_contents")

    # The 0001 layout, empty.
    op.create_table(
        "snapshot_contents",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("codec", sa.String(length=20), nullable=False),
        sa.Column("raw_size", _id(), nullable=False),
        sa.Column("stored_size", _id(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=_now(), nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_snapshot_contents")),
    )
    op.create_table(
        "agent_session_snapshots",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("message_id", sa.String(length=36), nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("content_digest", sa.String(length=64), nullable=False),
        sa.Column("raw_size", _id(), nullable=False),
        sa.Column("stored_size", _id(), nullable=False),
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
