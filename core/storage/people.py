"""One person's data: everything kept about them, read out (export) or removed (erase).

A person is a Slack member of one workspace, ``slack:TEAM:USER`` (their ``users`` row's
``external_id``). What the product keeps about them, and what erasing does to it:

- the sessions they own (``agent_sessions.user_id``) with their messages, sandbox snapshots,
  surface threads and message references, tool approvals and budget reservations: deleted
  (the foreign keys cascade from the session);
- the delivery records of the messages they sent (``deliveries.author`` in their workspace, or
  in one of their sessions): deleted, they hold the message's text;
- their votes on answers (``message_feedback.voter``), what they were last looking at
  (``surface_viewing``), their API tokens and web sign-ins, and their ``users`` row: deleted;
- the model requests their turns made (``usage_requests.user_key``): kept for the accounts
  (the workspace's and everyone's budgets and ``usage`` totals stay true), the person replaced
  by ``(erased)`` and the session and message taken out;
- decisions they made on tool calls in others' sessions (``tool_approvals.decided_by``), and
  calls the model asked for in answer to their message there (``tool_approvals.requested_by``):
  kept, their name replaced by ``(erased)`` (a reason they gave with a decision stays, as
  what they wrote in someone else's thread does).

What they wrote in a thread someone else owns stays in that thread's session: it is part of
the other person's conversation (and of the Slack thread itself, which Slack keeps).

Erasing is refused (``AgentSessionBusy``) while a turn of theirs runs: a turn holds the lock of
one of their sessions, or a message of theirs is being answered or waits to be. The check and
the deletions are one write transaction, and the sessions go by the same conditional delete as
``sessions delete`` (free of a live turn lock), so a turn that claims one meanwhile either
commits first (and the erase is refused) or finds its session gone.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, cast

from sqlalchemy import Table, delete, func, or_, select, update

from core.errors import AgentSessionBusy, UsageError
from core.storage.engine import Database
from core.storage.models import (
    AgentSession,
    AgentSessionMessage,
    ApiToken,
    Delivery,
    MessageFeedback,
    SurfaceViewing,
    ToolApproval,
    UsageRequest,
    User,
    WebSession,
)
from core.storage.queries import claimable, turn_active

USERS: Final = cast(Table, User.__table__)
SESSIONS: Final = cast(Table, AgentSession.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
FEEDBACK: Final = cast(Table, MessageFeedback.__table__)
VIEWING: Final = cast(Table, SurfaceViewing.__table__)
DELIVERIES: Final = cast(Table, Delivery.__table__)
USAGE: Final = cast(Table, UsageRequest.__table__)
APPROVALS: Final = cast(Table, ToolApproval.__table__)
TOKENS: Final = cast(Table, ApiToken.__table__)
SIGN_INS: Final = cast(Table, WebSession.__table__)

ERASED: Final = "(erased)"
# The delivery states of a message still being answered, or waiting to be (core.storage.deliveries).
_ANSWERING: Final = ("received", "started", "waiting")
_PERSON = re.compile(r"(?P<team>[TE][A-Z0-9]+):(?P<user>[UW][A-Z0-9]+)")


@dataclass(frozen=True)
class Person:
    """A Slack member as the command line names them (``TEAM:USER``) and as rows name them."""

    team: str
    user: str

    @classmethod
    def parse(cls, text: str, command: str) -> Person:
        found = _PERSON.fullmatch(text.strip())
        if found is None:
            raise UsageError(f"{command}: takes TEAM:USER (T123:U456), not {text!r}")
        return cls(found["team"], found["user"])

    @property
    def external_id(self) -> str:
        return f"slack:{self.team}:{self.user}"

    @property
    def viewer(self) -> str:
        return f"{self.team}:{self.user}"


@dataclass
class Erased:
    """What an erase removed (or anonymised), by kind, as ``user erase`` prints it."""

    sessions: int = 0
    messages: int = 0
    deliveries: int = 0
    feedback: int = 0
    tokens: int = 0
    sign_ins: int = 0
    viewing: int = 0
    person: int = 0
    usage_anonymised: int = 0
    decisions_anonymised: int = 0
    requests_anonymised: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def anything(self) -> bool:
        return any(
            (
                self.sessions,
                self.messages,
                self.deliveries,
                self.feedback,
                self.tokens,
                self.sign_ins,
                self.viewing,
                self.person,
                self.usage_anonymised,
                self.decisions_anonymised,
                self.requests_anonymised,
            )
        )


def _value(value: Any) -> Any:
    """A column's value as JSON can carry it."""
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _record(kind: str, row: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    fields = {k: _value(v) for k, v in row._mapping.items() if k not in skip}
    return {"record": kind, **fields}


class People:
    """Export and erase one person, on one database."""

    def __init__(self, db: Database, *, staleness_seconds: float) -> None:
        self._db = db
        self.staleness_seconds = staleness_seconds

    async def export(self, person: Person) -> AsyncIterator[dict[str, Any]]:
        """Every row about ``person``, one JSON-ready dict each, read in one transaction so
        the export is one consistent picture. ``record`` names the kind: ``person``,
        ``session``, ``message``, ``approval``, ``api_token``, ``web_sign_in``, ``usage``,
        ``feedback``, ``delivery``, ``viewing``. Secrets (token and cookie hashes) are left
        out: they open nothing and say nothing about the person."""
        async with self._db.read(large=True) as conn:
            user = (
                await conn.execute(select(USERS).where(USERS.c.external_id == person.external_id))
            ).first()
            if user is not None:
                yield _record("person", user)
                owned = select(SESSIONS.c.id).where(SESSIONS.c.user_id == user.id)
                sessions = await conn.execute(
                    select(SESSIONS).where(SESSIONS.c.user_id == user.id).order_by(SESSIONS.c.id)
                )
                for row in sessions.all():
                    yield _record("session", row, skip=("lock_token", "stop_token"))
                messages = await conn.execute(
                    select(
                        MESSAGES.c.session_id,
                        MESSAGES.c.position,
                        MESSAGES.c.message_id,
                        MESSAGES.c.is_compaction_message,
                        MESSAGES.c.message,
                        MESSAGES.c.created_at,
                    )
                    .where(MESSAGES.c.session_id.in_(owned))
                    .order_by(MESSAGES.c.session_id, MESSAGES.c.position)
                )
                for row in messages.all():
                    yield _record("message", row)
                approvals = await conn.execute(
                    select(APPROVALS)
                    .where(
                        or_(
                            APPROVALS.c.session_id.in_(owned),
                            APPROVALS.c.decided_by == person.external_id,
                            APPROVALS.c.requested_by == person.external_id,
                        )
                    )
                    .order_by(APPROVALS.c.requested_at, APPROVALS.c.id)
                )
                for row in approvals.all():
                    yield _record("approval", row)
                for table, kind, skip in (
                    (TOKENS, "api_token", ("token_hash",)),
                    (SIGN_INS, "web_sign_in", ("cookie_hash",)),
                ):
                    rows = await conn.execute(
                        select(table).where(table.c.user_id == user.id).order_by(table.c.id)
                    )
                    for row in rows.all():
                        yield _record(kind, row, skip=skip)
            usage = await conn.execute(
                select(USAGE).where(USAGE.c.user_key == person.external_id).order_by(USAGE.c.id)
            )
            for row in usage.all():
                yield _record("usage", row)
            votes = await conn.execute(
                select(FEEDBACK)
                .where(FEEDBACK.c.voter == person.external_id)
                .order_by(FEEDBACK.c.id)
            )
            for row in votes.all():
                yield _record("feedback", row)
            deliveries = await conn.execute(
                select(
                    DELIVERIES.c.id,
                    DELIVERIES.c.surface,
                    DELIVERIES.c.thread_key,
                    DELIVERIES.c.session_id,
                    DELIVERIES.c.message_id,
                    DELIVERIES.c.text,
                    DELIVERIES.c.state,
                    DELIVERIES.c.created_at,
                )
                .where(self._their_deliveries(person))
                .order_by(DELIVERIES.c.id)
            )
            for row in deliveries.all():
                yield _record("delivery", row)
            viewing = await conn.execute(select(VIEWING).where(VIEWING.c.person == person.viewer))
            for row in viewing.all():
                yield _record("viewing", row)

    @staticmethod
    def _their_deliveries(person: Person) -> Any:
        """Messages ``person`` sent that a surface recorded (Slack keys threads ``TEAM/…``)."""
        return (DELIVERIES.c.author == person.user) & DELIVERIES.c.thread_key.startswith(
            f"{person.team}/", autoescape=True
        )

    async def erase(self, person: Person) -> Erased:
        """Remove ``person``'s data (the module's docstring says what goes and what stays), or
        nothing at all: refused while a turn of theirs runs."""
        erased = Erased()
        async with self._db.write(large=True) as conn:
            user_id = await conn.scalar(
                select(USERS.c.id).where(USERS.c.external_id == person.external_id)
            )
            owned = select(SESSIONS.c.id).where(SESSIONS.c.user_id == user_id)
            answering = await conn.scalar(
                select(func.count())
                .select_from(DELIVERIES)
                .where(self._their_deliveries(person), DELIVERIES.c.state.in_(_ANSWERING))
            )
            if answering:
                raise AgentSessionBusy(
                    f"a message of {person.viewer} is being answered or waits to be;"
                    " erase again when it is done"
                )
            erased.feedback = int(
                await conn.scalar(
                    select(func.count())
                    .select_from(FEEDBACK)
                    .where(FEEDBACK.c.voter == person.external_id)
                )
                or 0
            )
            if user_id is not None:
                running = await conn.scalar(
                    select(func.count())
                    .select_from(SESSIONS)
                    .where(SESSIONS.c.user_id == user_id, turn_active(self.staleness_seconds))
                )
                if running:
                    raise AgentSessionBusy(
                        f"a turn is running in {running} session(s) of {person.viewer};"
                        " erase again when it is done"
                    )
                erased.messages = int(
                    await conn.scalar(
                        select(func.count())
                        .select_from(MESSAGES)
                        .where(MESSAGES.c.session_id.in_(owned))
                    )
                    or 0
                )
                gone = await conn.execute(
                    delete(DELIVERIES).where(
                        DELIVERIES.c.session_id.in_(owned), DELIVERIES.c.state.not_in(_ANSWERING)
                    )
                )
                erased.deliveries += gone.rowcount
                total = await conn.scalar(
                    select(func.count()).select_from(SESSIONS).where(SESSIONS.c.user_id == user_id)
                )
                gone = await conn.execute(
                    delete(SESSIONS).where(
                        SESSIONS.c.user_id == user_id, claimable(self.staleness_seconds)
                    )
                )
                if gone.rowcount != total:  # a turn claimed one since the check: nothing done
                    raise AgentSessionBusy(
                        f"a turn started in a session of {person.viewer}; erase again when"
                        " it is done"
                    )
                erased.sessions = gone.rowcount
                for table, name in ((TOKENS, "tokens"), (SIGN_INS, "sign_ins")):
                    gone = await conn.execute(delete(table).where(table.c.user_id == user_id))
                    setattr(erased, name, gone.rowcount)
                gone = await conn.execute(delete(USERS).where(USERS.c.id == user_id))
                erased.person = gone.rowcount
            # Only finished records: one that arrived since the check above is answered as usual.
            gone = await conn.execute(
                delete(DELIVERIES).where(
                    self._their_deliveries(person), DELIVERIES.c.state.not_in(_ANSWERING)
                )
            )
            erased.deliveries += gone.rowcount
            # Counted before: a vote on an answer in their own sessions went with the session.
            await conn.execute(delete(FEEDBACK).where(FEEDBACK.c.voter == person.external_id))
            gone = await conn.execute(delete(VIEWING).where(VIEWING.c.person == person.viewer))
            erased.viewing = gone.rowcount
            kept = await conn.execute(
                update(USAGE)
                .where(USAGE.c.user_key == person.external_id)
                .values(user_key=ERASED, session_id=None, message_id=None)
            )
            erased.usage_anonymised = kept.rowcount
            kept = await conn.execute(
                update(APPROVALS)
                .where(APPROVALS.c.decided_by == person.external_id)
                .values(decided_by=ERASED)
            )
            erased.decisions_anonymised = kept.rowcount
            kept = await conn.execute(
                update(APPROVALS)
                .where(APPROVALS.c.requested_by == person.external_id)
                .values(requested_by=ERASED)
            )
            erased.requests_anonymised = kept.rowcount
        return erased
