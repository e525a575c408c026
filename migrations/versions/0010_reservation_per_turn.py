"""One reservation row per turn (``usage_reservations``), with a column per account and unit,
instead of a row per account and unit.

A turn under three budgets inserted three rows at its claim (a table and two indexes) and its
release's trigger deleted them again: on SQLite those pages, written and committed twice per
turn, were about a third of what budgets added to a turn's bookkeeping (docs/benchmarks.md,
*The budget check at O(1)*, *Third pass*). The row is now keyed by its session alone, with
no other index: a claim reads every live turn's row, as an ``all`` budget's lookup did
already.

The live reservations are carried over: per session, the rows of the lock it still holds
become one row. Rows taken at different moments of one turn (a later request's step that held
fewer accounts) keep the latest moment, so what the turn spent in between is not subtracted
from the earlier ones: a reservation may be counted a little high across the upgrade, never
low. Rows of locks no longer held counted for nothing and are left behind. The trigger that
deletes a turn's rows with its lock (migration 0007) names only the session and the token, so
it serves the new table as it is.

Revision ID: 0010_reservation_per_turn
Revises: 0009_decision_reason
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0010_reservation_per_turn"
down_revision: str | None = "0009_decision_reason"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCOPES = ("user", "workspace", "all")
UNITS = {"tokens": "tokens", "usd": "nanousd"}  # a row's unit -> its column's suffix


def _id() -> sa.types.TypeEngine[int]:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _scope(account: str) -> str:
    return "all" if account == "all" else account.split(":", 1)[0]


def _held_rows() -> list[Any]:
    """The reservation rows that count: those of the lock their session still holds."""
    return list(
        op.get_bind().execute(
            sa.text(
                "SELECT r.session_id, r.lock_token, r.account, r.unit, r.amount, r.created_at"
                " FROM usage_reservations r JOIN agent_sessions s"
                " ON s.id = r.session_id AND s.lock_token = r.lock_token"
                " ORDER BY r.session_id, r.account, r.unit"
            )
        )
    )


def _per_turn(rows: Sequence[Any]) -> list[dict[str, Any]]:
    turns: dict[int, dict[str, Any]] = {}
    for session_id, token, account, unit, amount, created_at in rows:
        turn = turns.setdefault(
            session_id,
            {
                "session_id": session_id,
                "lock_token": token,
                "created_at": created_at,
                **{f"{scope}_{suffix}": None for scope in SCOPES for suffix in UNITS.values()},
                "user_account": None,
                "workspace_account": None,
            },
        )
        turn["created_at"] = max(turn["created_at"], created_at)
        scope = _scope(account)
        if scope != "all":
            turn[f"{scope}_account"] = account
        turn[f"{scope}_{UNITS[unit]}"] = amount
    return list(turns.values())


def _per_account(rows: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        for scope in SCOPES:
            account = "all" if scope == "all" else row[f"{scope}_account"]
            for unit, suffix in UNITS.items():
                amount = row[f"{scope}_{suffix}"]
                if account is None or amount is None:
                    continue
                out.append(
                    {
                        "session_id": row["session_id"],
                        "lock_token": row["lock_token"],
                        "account": account,
                        "unit": unit,
                        "amount": amount,
                        "created_at": row["created_at"],
                    }
                )
    return out


def _created_at() -> sa.Column[datetime]:
    return sa.Column(
        "created_at",
        sa.DateTime(timezone=True),
        server_default=_now(),
        nullable=False,
    )


def _now() -> sa.TextClause:
    if op.get_bind().dialect.name == "sqlite":
        return sa.text("(strftime('%Y-%m-%d %H:%M:%f000', 'now'))")
    return sa.text("statement_timestamp()")


def _insert(rows: list[dict[str, Any]]) -> None:
    """The rows as read: untyped columns, so SQLite's stored text goes back as it came."""
    if rows:
        table = sa.table("usage_reservations", *(sa.column(name) for name in rows[0]))
        op.bulk_insert(table, rows)


def upgrade() -> None:
    live = _per_turn(_held_rows())
    op.drop_table("usage_reservations")
    op.create_table(
        "usage_reservations",
        sa.Column("session_id", _id(), nullable=False, autoincrement=False),
        sa.Column("lock_token", sa.String(length=36), nullable=False),
        _created_at(),
        sa.Column("user_account", sa.String(length=300), nullable=True),
        sa.Column("workspace_account", sa.String(length=300), nullable=True),
        *(
            sa.Column(f"{scope}_{suffix}", _id(), nullable=True)
            for scope in SCOPES
            for suffix in UNITS.values()
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["agent_sessions.id"],
            name=op.f("fk_usage_reservations_session_id_agent_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_usage_reservations")),
    )
    _insert(live)


def downgrade() -> None:
    rows = [
        dict(row._mapping)
        for row in op.get_bind().execute(
            sa.text(
                "SELECT r.* FROM usage_reservations r JOIN agent_sessions s"
                " ON s.id = r.session_id AND s.lock_token = r.lock_token"
            )
        )
    ]
    op.drop_table("usage_reservations")
    op.create_table(
        "usage_reservations",
        sa.Column("id", _id(), autoincrement=True, nullable=False),
        sa.Column("session_id", _id(), nullable=False),
        sa.Column("lock_token", sa.String(length=36), nullable=False),
        sa.Column("account", sa.String(length=300), nullable=False),
        sa.Column("unit", sa.String(length=10), nullable=False),
        sa.Column("amount", _id(), nullable=False),
        _created_at(),
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
    op.create_index(
        op.f("ix_usage_reservations_session_id_account_unit"),
        "usage_reservations",
        ["session_id", "account", "unit"],
        unique=True,
    )
    _insert(_per_account(rows))
