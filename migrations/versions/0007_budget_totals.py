"""Running totals per budget account and window (``usage_totals``), so a claim's budget check
reads a few rows instead of summing the window's ledger; an index to find a session's last
request (the claim projects its turn's input from it); one reservation row per session and
account, replaced in place by the next claim and deleted by a trigger when the turn's lock is
released or taken over.

The totals of the current month (and so of today) are filled from the ledger rows already
there: a budget in force across the upgrade keeps counting what was spent before it.

Revision ID: 0007_budget_totals
Revises: 0006_web_access
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0007_budget_totals"
down_revision: str | None = "0006_web_access"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "usage_totals",
        sa.Column("account", sa.String(length=300), nullable=False),
        sa.Column("period", sa.String(length=10), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tokens", _id(), nullable=False),
        sa.Column("nanousd", _id(), nullable=False),
        sa.Column("output_tokens", _id(), nullable=False),
        sa.Column("requests", _id(), nullable=False),
        sa.Column("priced_requests", _id(), nullable=False),
        sa.PrimaryKeyConstraint("account", "period", "window_start", name=op.f("pk_usage_totals")),
    )
    op.create_index(
        op.f("ix_usage_requests_session_id_created_at"),
        "usage_requests",
        ["session_id", "created_at"],
    )
    # A claim now replaces its session's reservation in place (one row per session and
    # account). Reservations only live as long as a turn: those of turns running across the
    # upgrade are dropped (earlier ones could repeat a session and account).
    op.execute("DELETE FROM usage_reservations")
    op.create_index(
        op.f("ix_usage_reservations_session_id_account_unit"),
        "usage_reservations",
        ["session_id", "account", "unit"],
        unique=True,
    )
    # Its prefix serves what the index on session_id alone did (one index less to write).
    op.drop_index(op.f("ix_usage_reservations_session_id"), table_name="usage_reservations")
    _end_with_the_lock()
    _fill()


# A turn's reservation ends with its hold on the session's lock: the statement that releases
# the lock or takes it over deletes the rows of the token it replaces, inside the database, so
# no turn pays a statement for it and a claim only ever scans live turns' rows (and those of
# turns that died and whose session nobody has claimed since).
_SQLITE_TRIGGER = """
CREATE TRIGGER usage_reservations_end AFTER UPDATE OF lock_token ON agent_sessions
WHEN OLD.lock_token IS NOT NULL AND (NEW.lock_token IS NULL OR NEW.lock_token != OLD.lock_token)
BEGIN
    DELETE FROM usage_reservations WHERE session_id = OLD.id AND lock_token = OLD.lock_token;
END
"""
_PG_FUNCTION = """
CREATE FUNCTION usage_reservations_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM usage_reservations WHERE session_id = OLD.id AND lock_token = OLD.lock_token;
    RETURN NULL;
END
$$
"""
_PG_TRIGGER = """
CREATE TRIGGER usage_reservations_end AFTER UPDATE OF lock_token ON agent_sessions
FOR EACH ROW WHEN (OLD.lock_token IS NOT NULL AND OLD.lock_token IS DISTINCT FROM NEW.lock_token)
EXECUTE FUNCTION usage_reservations_end()
"""


def _end_with_the_lock() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_SQLITE_TRIGGER)
    else:
        op.execute(_PG_FUNCTION)
        op.execute(_PG_TRIGGER)


def _fill() -> None:
    """This month's totals from the ledger rows already written (windows in UTC)."""
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    now = datetime.now(UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    since = month.replace(tzinfo=None) if sqlite else month
    rows = bind.execute(
        sa.text(
            "SELECT user_key, workspace, created_at, counted_tokens, output_tokens, cost_nanousd"
            " FROM usage_requests WHERE created_at >= :since"
        ),
        {"since": since.isoformat(sep=" ") if sqlite else since},
    )
    totals: dict[tuple[str, str, datetime], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for user, workspace, created, counted, output, cost in rows:
        if isinstance(created, str):
            created = datetime.fromisoformat(created)
        created = created.replace(tzinfo=UTC) if created.tzinfo is None else created
        day = created.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        accounts = ["all"]
        if user is not None:
            accounts.append(f"user:{user}")
        if workspace is not None:
            accounts.append(f"workspace:{workspace}")
        for account in accounts:
            for period, start in (("day", day), ("month", month)):
                total = totals[(account, period, start)]
                total[0] += counted or 0
                total[1] += cost or 0
                total[2] += output or 0
                total[3] += 1
                total[4] += cost is not None
    if not totals:
        return
    table = sa.table(
        "usage_totals",
        sa.column("account"),
        sa.column("period"),
        sa.column("window_start", sa.DateTime(timezone=not sqlite)),
        sa.column("tokens"),
        sa.column("nanousd"),
        sa.column("output_tokens"),
        sa.column("requests"),
        sa.column("priced_requests"),
    )
    op.bulk_insert(
        table,
        [
            {
                "account": account,
                "period": period,
                # SQLite keeps naive UTC text, as the models' UtcDateTime writes it.
                "window_start": start.replace(tzinfo=None) if sqlite else start,
                "tokens": total[0],
                "nanousd": total[1],
                "output_tokens": total[2],
                "requests": total[3],
                "priced_requests": total[4],
            }
            for (account, period, start), total in totals.items()
        ],
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS usage_reservations_end" + _on_sessions())
    if op.get_bind().dialect.name != "sqlite":
        op.execute("DROP FUNCTION IF EXISTS usage_reservations_end()")
    op.create_index(op.f("ix_usage_reservations_session_id"), "usage_reservations", ["session_id"])
    op.drop_index(
        op.f("ix_usage_reservations_session_id_account_unit"), table_name="usage_reservations"
    )
    op.drop_index(op.f("ix_usage_requests_session_id_created_at"), table_name="usage_requests")
    op.drop_table("usage_totals")


def _on_sessions() -> str:
    return "" if op.get_bind().dialect.name == "sqlite" else " ON agent_sessions"
