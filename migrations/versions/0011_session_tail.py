"""The session's tail on its own row (``agent_sessions.tail_message_id``), so a claim and the
stale guard can be one statement.

The stale guard compared the client's ``last_message_id`` with the tail read from the
messages. As a statement of its own, after the claim in the claim's transaction, that is safe;
folded into the claim's statement it is not on PostgreSQL: a claim that waits on the session
row's lock while a release appends the answer re-checks the row's newest version
(EvalPlanQual), but a subquery on the messages keeps the statement's older snapshot and misses
the answer. On the session row itself the guard is re-checked with the rest of the claim.

Every statement that appends or removes a session's messages moves the column in the same
transaction (``core.storage.queries``). Existing sessions get their tail from their messages
here (one UPDATE over the sessions; an index seek on ``(session_id, position)`` each).

On PostgreSQL, where replicas of the previous release keep running through a rolling upgrade
(the Helm chart's), the database keeps the column too: two statement-level triggers on the
messages, one after inserts and one after deletes, set each touched session's tail from its
messages whenever it differs. A previous release's replica appends and rewinds without knowing
the column, and its writes move it all the same. This release's statements set it themselves,
and its connections say so (the setting ``slack_agent.keeps_tail``): for them the triggers do
not fire at all (they cost a message about 0.07 ms on PostgreSQL when they do, finding the
column already right). Without them a new replica's claim would let
through a client whose view an old replica's answer had moved on. SQLite runs one replica: an
upgrade restarts it, so nothing older writes beside it.

Revision ID: 0011_session_tail
Revises: 0010_reservation_per_turn
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_session_tail"
down_revision: str | None = "0010_reservation_per_turn"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agent_sessions") as batch_op:
        batch_op.add_column(sa.Column("tail_message_id", sa.String(length=36), nullable=True))
    op.execute(
        "UPDATE agent_sessions SET tail_message_id = ("
        " SELECT m.message_id FROM agent_session_messages m"
        " WHERE m.session_id = agent_sessions.id ORDER BY m.position DESC LIMIT 1)"
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FOLLOW)
        for trigger, event, table in _PG_TRIGGERS:
            op.execute(
                f"CREATE TRIGGER {trigger} AFTER {event} ON agent_session_messages"
                f" REFERENCING {table} TABLE AS touched FOR EACH STATEMENT"
                f" WHEN (current_setting('{_KEEPS_TAIL}', true) IS DISTINCT FROM 'on')"
                " EXECUTE FUNCTION agent_session_tail_follows()"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for trigger, _, _ in _PG_TRIGGERS:
            op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON agent_session_messages")
        op.execute("DROP FUNCTION IF EXISTS agent_session_tail_follows()")
    with op.batch_alter_table("agent_sessions") as batch_op:
        batch_op.drop_column("tail_message_id")


# The sessions a statement added messages to or removed them from get their tail from their
# messages, where it differs (one UPDATE a statement: a fork's copy of 10,000 messages or a
# sweep's delete costs one, not one a row). ``touched`` is the statement's transition table.
_PG_FOLLOW = """
CREATE FUNCTION agent_session_tail_follows() RETURNS trigger LANGUAGE plpgsql AS $$
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
# The setting this release's connections carry (``core.storage.engine.KEEPS_TAIL``), written
# out here: a migration does not follow the code's later changes.
_KEEPS_TAIL = "slack_agent.keeps_tail"
_PG_TRIGGERS = (
    ("agent_session_messages_tail_added", "INSERT", "NEW"),
    ("agent_session_messages_tail_removed", "DELETE", "OLD"),
)
