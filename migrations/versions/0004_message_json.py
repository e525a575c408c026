"""A message's document as PostgreSQL's ``json`` instead of JSONB.

A history load reads every message as text: JSONB has to write each one out again (13-21 ms of
the server's CPU for 10,000 messages), ``json`` returns the text as stored (5-6 ms). No query
searches or indexes inside a message. SQLite keeps its JSON (text there already), so this
changes nothing on SQLite.

The change rewrites the table and its indexes under an exclusive lock, like any column type
change: 0.8 s for 140,000 messages (79 MB with indexes) on the benchmark machine, and about as
long back; turns wait meanwhile. Reversible: ``downgrade`` converts the documents back to JSONB.
A replica of the previous version still running when it is applied reads and writes messages
as before (PostgreSQL casts between the two types on assignment), but its forks fail
(``jsonb_set`` of a ``json`` column) and each pooled connection fails one statement that was
prepared before the change; replicas restart with a deploy.

Revision ID: 0004_message_json
Revises: 0003_approvals
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004_message_json"
down_revision: str | None = "0003_approvals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _message_column(
    to: sa.types.TypeEngine[object], cast: str, was: sa.types.TypeEngine[object]
) -> None:
    """The messages' document column converted to ``to`` (PostgreSQL only: SQLite's JSON is
    text either way)."""
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column(
            "agent_session_messages",
            "message",
            type_=to,
            existing_type=was,
            existing_nullable=False,
            postgresql_using=f"message::{cast}",
        )


def upgrade() -> None:
    _message_column(sa.JSON(), "json", postgresql.JSONB())


def downgrade() -> None:
    _message_column(postgresql.JSONB(), "jsonb", sa.JSON())
