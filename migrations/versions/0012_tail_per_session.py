"""The tail triggers look up each touched session's newest message once, not once a row.

Migration 0011's function (``agent_session_tail_follows``, run by the statement-level
triggers on ``agent_session_messages`` for a previous release's replicas) selected
``DISTINCT session_id, (newest message of that session)`` from the statement's transition
table: the subquery is part of the select list, so PostgreSQL evaluates it for every row
before DISTINCT folds them. An old replica's fork of 10,000 messages into one session made
10,000 index probes where one would do. Here the distinct sessions come first and the
subquery runs once for each (docs/benchmarks.md, *The tail triggers*, has the two measured).

Only the function's body changes (``CREATE OR REPLACE FUNCTION``): the triggers, and their
``WHEN`` that skips connections saying ``slack_agent.keeps_tail = on`` (this release's, which
move the tail themselves), stay as 0011 made them. The downgrade puts 0011's body back.
Nothing on SQLite, which has no triggers here (one replica: nothing older writes beside it).

Revision ID: 0012_tail_per_session
Revises: 0011_session_tail
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012_tail_per_session"
down_revision: str | None = "0011_session_tail"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_FOLLOW_PER_SESSION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_FOLLOW_PER_ROW)


# The sessions the statement touched (``touched``, its transition table), each once; then
# each one's newest message, where it differs from the session's tail. DISTINCT in a subquery
# of its own keeps PostgreSQL from pulling the lookup up into the rows before they are folded.
_FOLLOW_PER_SESSION = """
CREATE OR REPLACE FUNCTION agent_session_tail_follows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE agent_sessions AS s SET tail_message_id = t.message_id
    FROM (
        SELECT d.session_id AS session_id, (
            SELECT m.message_id FROM agent_session_messages AS m
            WHERE m.session_id = d.session_id ORDER BY m.position DESC LIMIT 1
        ) AS message_id
        FROM (SELECT DISTINCT touched.session_id AS session_id FROM touched) AS d
    ) AS t
    WHERE s.id = t.session_id AND s.tail_message_id IS DISTINCT FROM t.message_id;
    RETURN NULL;
END
$$
"""

# Migration 0011's body, word for word (a migration does not follow later code).
_FOLLOW_PER_ROW = """
CREATE OR REPLACE FUNCTION agent_session_tail_follows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE agent_sessions AS s SET tail_message_id = t.message_id
    FROM (
        SELECT DISTINCT touched.session_id AS session_id, (
            SELECT m.message_id FROM agent_session_messages AS m
            WHERE m.session_id = touched.session_id ORDER BY m.position DESC LIMIT 1
        ) AS message_id
        FROM touched
    ) AS t
    WHERE s.id = t.session_id AND s.tail_message_id IS DISTINCT FROM t.message_id;
    RETURN NULL;
END
$$
"""
