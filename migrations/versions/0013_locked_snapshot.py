"""A function that says, after a statement took the budget's advisory locks, what a fresh
snapshot is: so a budgeted claim can be one autocommitted statement on PostgreSQL.

A budgeted claim must read the budget after it holds the accounts' advisory locks, so that
it sees what their earlier holders committed; READ COMMITTED takes a statement's snapshot
when the statement starts, before any lock it takes. ``core.storage.reservations`` therefore
has the claim's statement try the locks (never waiting on them) and pass the result to this
function, which, being VOLATILE and PL/pgSQL (never inlined), takes a snapshot of its own,
after the locks. When that snapshot is the statement's own (``pg_current_snapshot()``, text
equal: no transaction ended between the two), the statement's reads saw everything the
locks' earlier holders committed, and it may admit the turn; when not, it writes nothing and
the claim takes the locks the waiting way (``core.storage.advisory``), as before. NULL when
a lock was not taken. docs/design.md, *Budgets across replicas*, argues it.

Nothing on SQLite, whose write transactions hold the database's one write lock.

Revision ID: 0013_locked_snapshot
Revises: 0012_tail_per_session
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from core.errors import DatabaseError

revision: str = "0013_locked_snapshot"
down_revision: str | None = "0012_tail_per_session"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    version = int(bind.exec_driver_sql("SHOW server_version_num").scalar_one())
    if version < 130000:  # pg_current_snapshot() came with 13: say so now, not at every claim
        raise DatabaseError(f"PostgreSQL 13 or newer is needed (server_version_num {version})")
    op.execute(_LOCKED_SNAPSHOT)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION usage_locked_snapshot(boolean)")


_LOCKED_SNAPSHOT = """
CREATE FUNCTION usage_locked_snapshot(taken boolean) RETURNS text
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $$
BEGIN
    IF taken THEN
        RETURN pg_current_snapshot()::text;
    END IF;
    RETURN NULL;
END
$$
"""
