"""An approval request's arguments kept as exact text, and why a request ended.

``tool_approvals.arguments`` becomes text (JSON written by the standard library, ASCII only):
JSONB rewrote numbers (``1e2`` read back as ``100``) and refused a NUL, so an approved call could
differ from its digest, or asking for it failed the turn. ``reason`` says why a request ended
where it did (``core.storage.approvals``). On SQLite the table is rebuilt (batch mode); on
PostgreSQL the column's type changes in place, rewriting the table under an exclusive lock (a
table of requests, small). Reversible: ``downgrade`` converts the text back to JSONB, with every
escaped NUL replaced (U+FFFD), as the transcript keeps it.

Revision ID: 0005_approval_ends
Revises: 0004_message_json
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005_approval_ends"
down_revision: str | None = "0004_message_json"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    using = {"postgresql_using": "arguments::text"}
    with op.batch_alter_table("tool_approvals") as batch_op:
        batch_op.alter_column(
            "arguments", type_=sa.Text(), existing_type=_json(), existing_nullable=False, **using
        )
        batch_op.add_column(sa.Column("reason", sa.String(length=40), nullable=True))


def downgrade() -> None:
    using = {"postgresql_using": "replace(arguments, '\\u0000', '\\ufffd')::jsonb"}
    with op.batch_alter_table("tool_approvals") as batch_op:
        batch_op.drop_column("reason")
        batch_op.alter_column(
            "arguments", type_=_json(), existing_type=sa.Text(), existing_nullable=False, **using
        )
