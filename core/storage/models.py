"""The ORM models; the names are fixed because operators and other tools read them.

Constraint names follow one convention so that Alembic migrations name them identically on
SQLite and PostgreSQL. Ids of rows are integers (ties in the per-user cap break on them);
message ids are UUID strings, and ``message_id`` always equals ``message["id"]``:
``validate_message`` is the single check, applied by the ORM on construction and on assignment,
and by the store on every bulk insert.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    event,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, Mapper, mapped_column, validates
from sqlalchemy.types import TypeDecorator

from core.errors import InvalidMessage
from core.storage.dialect import UtcDateTime, db_now

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JsonDoc = JSON().with_variant(JSONB(), "postgresql")
# A message's document: PostgreSQL's ``json`` (the text as written, validated on the way in),
# not JSONB. A history load reads every message as text: for 10,000 messages the server spent
# 13-21 ms of CPU writing JSONB out as text, 5-6 ms returning ``json`` as stored, and no query
# searches or indexes inside a message (docs/benchmarks.md, *History load of 10,000
# messages*). SQLite stores JSON as text either way.
MessageDoc = JSON()


class ExactJson(TypeDecorator[dict[str, Any]]):
    """A JSON object kept as the text it was written as, and read back by the standard library.

    For what a digest names (an approval's arguments): JSONB rewrites numbers (``1e2`` comes
    back as ``100``) and refuses ``\\u0000``, and the documents' fast reader (orjson) reads an
    integer past 64 bits as a float; any of those would make an approved call differ from the
    call the person approved. ASCII-only text, so a NUL or a lone surrogate is an escape that
    both databases store."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: dict[str, Any] | None, dialect: Dialect) -> str | None:
        return None if value is None else json.dumps(value, ensure_ascii=True)

    def process_result_value(self, value: str | None, dialect: Dialect) -> dict[str, Any] | None:
        return None if value is None else cast(dict[str, Any], json.loads(value))


# BIGINT on PostgreSQL, INTEGER on SQLite (where only INTEGER PRIMARY KEY is the rowid alias).
Id = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _created() -> Mapped[datetime]:
    return mapped_column(UtcDateTime(), nullable=False, server_default=db_now())


def validate_message(message: Any, message_id: str | None = None) -> str:
    """Return the message's id after checking the invariants every stored message keeps.

    ``message`` must be a UIMessage-shaped dict whose ``id`` is a canonical UUID string; when a
    ``message_id`` is given separately it must be the same.
    """
    if not isinstance(message, dict):
        raise InvalidMessage("a message must be a JSON object")
    raw_id = message.get("id")
    if not isinstance(raw_id, str):
        raise InvalidMessage("message.id must be a UUID string")
    try:
        canonical = str(uuid.UUID(raw_id))
    except ValueError:
        raise InvalidMessage(f"message.id {raw_id!r} is not a UUID") from None
    if canonical != raw_id:
        raise InvalidMessage(f"message.id {raw_id!r} is not in canonical UUID form")
    if message.get("role") not in ("user", "assistant", "system"):
        raise InvalidMessage("message.role must be user, assistant or system")
    if not isinstance(message.get("parts", []), list):
        raise InvalidMessage("message.parts must be a list")
    if message_id is not None and message_id != raw_id:
        raise InvalidMessage(f"message_id {message_id!r} differs from message.id {raw_id!r}")
    return raw_id


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    external_id: Mapped[str] = mapped_column(String(255), nullable=False, unique=True)
    display_name: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = _created()


class CustomProvider(Base):
    __tablename__ = "custom_providers"
    __table_args__ = (CheckConstraint("kind IN ('openai', 'anthropic')", name="kind"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), nullable=False, unique=True)
    kind: Mapped[str] = mapped_column(String(20), nullable=False)
    base_url: Mapped[str] = mapped_column(String(2048), nullable=False)
    api_key_env: Mapped[str] = mapped_column(String(255), nullable=False)
    default_model: Mapped[str | None] = mapped_column(String(255))
    # The provider's own prices in US dollars per million tokens, as decimal text (exact on
    # both databases); null: priced from genai-prices' table by ``base_url``, if it knows it.
    input_usd_per_million: Mapped[str | None] = mapped_column(String(40))
    output_usd_per_million: Mapped[str | None] = mapped_column(String(40))
    cached_usd_per_million: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = _created()


class AgentSession(Base):
    __tablename__ = "agent_sessions"
    __table_args__ = (
        UniqueConstraint("project_name", "project_session_id"),
        Index(None, "user_id", "updated_at"),
        Index(None, "expires_at"),
        Index(None, "updated_at"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    project_session_id: Mapped[str] = mapped_column(String(255), nullable=False)
    project_name: Mapped[str] = mapped_column(String(100), nullable=False)
    user_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("users.id", ondelete="CASCADE"), nullable=True
    )
    title: Mapped[str | None] = mapped_column(String(255))
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    heartbeat_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    lock_token: Mapped[str | None] = mapped_column(String(36))
    # The token of a turn someone asked to stop (a stop button): the turn holding that token
    # stops when it sees it. Never compared with anything but the current ``lock_token``.
    stop_token: Mapped[str | None] = mapped_column(String(36))
    model_provider: Mapped[str | None] = mapped_column(String(100))
    model_name: Mapped[str | None] = mapped_column(String(255))
    custom_provider_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("custom_providers.id", ondelete="SET NULL"), nullable=True
    )
    builtin_provider: Mapped[str | None] = mapped_column(String(100))
    # The id of the session's last message (NULL: none), moved by every statement that
    # appends or removes its messages, in the same transaction. The stale guard compares it,
    # so the guard is a predicate on this row: PostgreSQL re-checks it on the row's newest
    # version when a claim waited on the row's lock (a subquery on the messages would keep
    # the claim's older snapshot). See docs/design.md, *The turn protocol*.
    tail_message_id: Mapped[str | None] = mapped_column(String(36))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class AgentSessionMessage(Base):
    __tablename__ = "agent_session_messages"
    __table_args__ = (
        UniqueConstraint("session_id", "position"),
        # Finds the latest checkpoint of a session without reading its history. Partial: only
        # checkpoints are indexed, so ordinary inserts (and a fork's bulk copy) skip it.
        Index(
            "ix_agent_session_messages_checkpoints",
            "session_id",
            "position",
            postgresql_where=text("is_compaction_message = true"),
            sqlite_where=text("is_compaction_message = 1"),
        ),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(
        Id, ForeignKey("agent_sessions.id", ondelete="CASCADE"), nullable=False
    )
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    message: Mapped[dict[str, Any]] = mapped_column(MessageDoc, nullable=False)
    message_id: Mapped[str] = mapped_column(String(36), nullable=False, unique=True)
    is_compaction_message: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=False, server_default=false()
    )
    created_at: Mapped[datetime] = _created()

    @validates("message")
    def _derive_message_id(self, _key: str, message: dict[str, Any]) -> dict[str, Any]:
        self.message_id = validate_message(message)
        return message

    @validates("message_id")
    def _check_message_id(self, _key: str, message_id: str) -> str:
        message = self.__dict__.get("message")
        if message is not None:
            validate_message(message, message_id)
        return message_id


@event.listens_for(AgentSessionMessage, "before_insert")
@event.listens_for(AgentSessionMessage, "before_update")
def _check_before_write(_mapper: Mapper[Any], _conn: Any, target: AgentSessionMessage) -> None:
    # The validators see each assignment; this sees the final pair (e.g. a mutated dict).
    validate_message(target.message, target.message_id)


class SnapshotContent(Base):
    """One bashkit snapshot object, content-addressed (``digest`` is bashkit's object id).

    Identical objects are stored once, whichever message, session or fork refers to them. A row
    is either self-contained (``base_id`` null: bashkit's own encoding, or zstd of the decoded
    object) or a zstd delta whose dictionary is a self-contained row (``base_id``), so decoding
    any row needs at most one other row: there are no chains to replay. A row may be rewritten
    from a delta to self-contained, never the other way, so a row chosen as a base stays one.
    """

    __tablename__ = "snapshot_contents"
    __table_args__ = (
        CheckConstraint(
            "(codec = 'zstd-delta' AND base_id IS NOT NULL)"
            " OR (codec <> 'zstd-delta' AND base_id IS NULL)",
            name="delta_has_base",
        ),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    codec: Mapped[str] = mapped_column(String(20), nullable=False)
    base_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("snapshot_contents.id"), nullable=True, index=True
    )
    raw_size: Mapped[int] = mapped_column(Id, nullable=False)
    stored_size: Mapped[int] = mapped_column(Id, nullable=False)
    data: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    # Also refreshed when a writer reuses an old row, so the sweeper's grace period protects it.
    created_at: Mapped[datetime] = _created()


class SnapshotSet(Base):
    """A content-addressed set of objects: a snapshot is the union of at most two of them.

    A snapshot names a large *base* set (shared by the consecutive snapshots of a session and
    by its forks) and a small *delta* set (the objects that are not in the base), so the
    references a message adds grow with what changed, not with the size of the workspace.
    """

    __tablename__ = "snapshot_sets"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    size: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = _created()


class SnapshotSetMember(Base):
    """Set membership as rows, so reachability (restore, garbage collection) is plain SQL."""

    __tablename__ = "snapshot_set_members"
    __table_args__ = (Index(None, "content_id"),)

    set_id: Mapped[int] = mapped_column(
        Id, ForeignKey("snapshot_sets.id", ondelete="CASCADE"), primary_key=True
    )
    content_id: Mapped[int] = mapped_column(
        Id, ForeignKey("snapshot_contents.id"), primary_key=True
    )


class AgentSessionSnapshot(Base):
    """The sandbox state after one message: references to content, never the bytes.

    ``content_digest`` is the bashkit commit to check out; the objects are the members of
    ``base_set_id`` and ``delta_set_id`` (which always include the commit itself).
    ``position`` is the message's position, kept in step with it, so a session's newest state
    (at or before a position) is one seek on ``(session_id, position)``, however long the
    session and however long ago its last snapshot.
    """

    __tablename__ = "agent_session_snapshots"
    __table_args__ = (UniqueConstraint("session_id", "position"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    message_id: Mapped[str] = mapped_column(
        String(36),
        ForeignKey("agent_session_messages.message_id", ondelete="CASCADE"),
        nullable=False,
        unique=True,
    )
    session_id: Mapped[int] = mapped_column(
        Id, ForeignKey("agent_sessions.id", ondelete="CASCADE"), nullable=False
    )
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    content_digest: Mapped[str] = mapped_column(String(64), nullable=False)
    base_set_id: Mapped[int] = mapped_column(
        Id, ForeignKey("snapshot_sets.id"), nullable=False, index=True
    )
    delta_set_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("snapshot_sets.id"), nullable=True, index=True
    )
    # The state's decoded size, and the bytes its capture added to storage (content + refs).
    raw_size: Mapped[int] = mapped_column(Id, nullable=False)
    stored_size: Mapped[int] = mapped_column(Id, nullable=False)
    created_at: Mapped[datetime] = _created()


class SystemSetting(Base):
    """Values set at run time (retention) that override the environment."""

    __tablename__ = "system_settings"

    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[Any] = mapped_column(JsonDoc, nullable=False)
    updated_at: Mapped[datetime] = _created()


# -- surface state: what a chat surface (Slack) remembers beside the sessions ----------------------
# Keyed by a surface name ("slack"), so the core stays surface-neutral; the statements live in
# ``core.storage.surface_state``.


class SurfaceThread(Base):
    """A surface's thread showing a session, and the tail that thread last showed (stale guard)."""

    __tablename__ = "surface_threads"
    __table_args__ = (UniqueConstraint("surface", "thread_key"), Index(None, "session_id"))

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    surface: Mapped[str] = mapped_column(String(50), nullable=False)
    thread_key: Mapped[str] = mapped_column(String(255), nullable=False)
    session_id: Mapped[int] = mapped_column(
        Id, ForeignKey("agent_sessions.id", ondelete="CASCADE"), nullable=False
    )
    last_shown_message_id: Mapped[str | None] = mapped_column(String(36))
    updated_at: Mapped[datetime] = _created()


class SurfaceMessageRef(Base):
    """A message as the surface shows it (a Slack ts) and the transcript message it stands for.

    No foreign key on ``message_id``: after a rewind the surface still needs to find (and mark)
    its posts of the deleted messages.
    """

    __tablename__ = "surface_message_refs"
    __table_args__ = (
        UniqueConstraint("surface", "ref_key"),
        Index(None, "message_id"),
        Index(None, "session_id"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    surface: Mapped[str] = mapped_column(String(50), nullable=False)
    ref_key: Mapped[str] = mapped_column(String(255), nullable=False)
    session_id: Mapped[int] = mapped_column(
        Id, ForeignKey("agent_sessions.id", ondelete="CASCADE"), nullable=False
    )
    message_id: Mapped[str] = mapped_column(String(36), nullable=False)
    kind: Mapped[str] = mapped_column(String(20), nullable=False)
    created_at: Mapped[datetime] = _created()


class MessageFeedback(Base):
    """A person's vote on an answer (Slack's feedback buttons): one per person and message,
    the latest click wins. Goes with the message when a rewind deletes it."""

    __tablename__ = "message_feedback"
    __table_args__ = (
        UniqueConstraint("message_id", "voter"),
        CheckConstraint("value IN ('good', 'bad')", name="value"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    message_id: Mapped[str] = mapped_column(
        String(36),
        ForeignKey("agent_session_messages.message_id", ondelete="CASCADE"),
        nullable=False,
    )
    voter: Mapped[str] = mapped_column(String(255), nullable=False)
    value: Mapped[str] = mapped_column(String(10), nullable=False)
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class SurfaceStash(Base):
    """State a surface keeps between a message it posted and a click on it (a picker's
    choices, a confirmation's target), so the click can land on any replica and carry more
    than a button's value may hold. Swept after a day."""

    __tablename__ = "surface_stash"
    __table_args__ = (Index(None, "created_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    surface: Mapped[str] = mapped_column(String(50), nullable=False)
    value: Mapped[dict[str, Any]] = mapped_column(JsonDoc, nullable=False)
    created_at: Mapped[datetime] = _created()


class SurfaceViewing(Base):
    """What a person is looking at in the surface right now (Slack's ``app_context_changed``:
    the channel beside the agent's Messages tab), so any replica can tell the agent."""

    __tablename__ = "surface_viewing"

    surface: Mapped[str] = mapped_column(String(50), primary_key=True)
    person: Mapped[str] = mapped_column(String(255), primary_key=True)
    context: Mapped[dict[str, Any]] = mapped_column(JsonDoc, nullable=False)
    updated_at: Mapped[datetime] = _created()


class Delivery(Base):
    """A message a surface received, from before it was acknowledged until it was answered.

    The durable half of "never lose an acknowledged message": ``state`` moves
    ``received`` -> ``started`` -> ``done``, or through ``waiting`` (busy session, or behind an
    earlier message of the same thread), ``offered``/``stale`` (a person decides) and ends in
    ``done``, ``discarded``, ``expired`` or ``failed``. While a record is active its ``owner``
    (one replica's process) refreshes ``lease_at``; a lease older than the turn lock's staleness
    window lets another replica take the record over. ``id`` is arrival order: a thread's
    records are answered in it. The statements live in ``core.storage.deliveries``.
    """

    __tablename__ = "deliveries"
    __table_args__ = (
        UniqueConstraint("surface", "event_key"),
        Index(None, "surface", "thread_key", "id"),
        Index(None, "state", "lease_at"),
        Index(None, "owner"),
        Index(None, "updated_at"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    surface: Mapped[str] = mapped_column(String(50), nullable=False)
    event_key: Mapped[str] = mapped_column(String(255), nullable=False)
    thread_key: Mapped[str] = mapped_column(String(255), nullable=False)
    session_id: Mapped[int | None] = mapped_column(
        Id, ForeignKey("agent_sessions.id", ondelete="SET NULL"), nullable=True
    )
    author: Mapped[str] = mapped_column(String(255), nullable=False)
    message_id: Mapped[str] = mapped_column(String(36), nullable=False)
    text: Mapped[str] = mapped_column(Text, nullable=False)
    context: Mapped[dict[str, Any]] = mapped_column(JsonDoc, nullable=False)
    state: Mapped[str] = mapped_column(String(20), nullable=False)
    wait_reason: Mapped[str | None] = mapped_column(String(20))
    owner: Mapped[str | None] = mapped_column(String(36))
    lease_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    takeovers: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    waiting_since: Mapped[datetime | None] = mapped_column(UtcDateTime())
    # Where the surface shows the answer (a Slack message ts), once the reply started: a replica
    # that takes the record over finishes a reply the dead one left half-written.
    reply_ref: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


# -- usage: what model requests used, and what running turns hold against a budget -----------------
# The statements live in ``core.storage.usage``.


class UsageRequest(Base):
    """One model request, as its provider reported it: the ledger budgets and ``usage`` read.

    Kept apart from the transcript on purpose: a rewind or the sweeper deletes messages and
    sessions, never what was spent (``session_id`` and ``message_id`` are plain values, not
    foreign keys). ``counted_tokens`` is what token budgets count: input + output as reported,
    or an estimate when the provider reported none (``counts_estimated``). ``cost_nanousd`` is
    the cost in billionths of a US dollar (integers add exactly on both databases), ``NULL``
    when the price is unknown.
    """

    __tablename__ = "usage_requests"
    __table_args__ = (
        Index(None, "created_at"),
        Index(None, "user_key", "created_at"),
        Index(None, "workspace", "created_at"),
        # A claim projects its turn's input from the session's last request, and counts what
        # running turns have spent since they reserved (budgets).
        Index(None, "session_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    session_id: Mapped[int | None] = mapped_column(Id)
    message_id: Mapped[str | None] = mapped_column(String(36))
    user_key: Mapped[str | None] = mapped_column(String(255))
    workspace: Mapped[str | None] = mapped_column(String(255))
    surface: Mapped[str | None] = mapped_column(String(50))
    kind: Mapped[str] = mapped_column(String(20), nullable=False)
    provider: Mapped[str] = mapped_column(String(100), nullable=False)
    model: Mapped[str] = mapped_column(String(255), nullable=False)
    input_tokens: Mapped[int | None] = mapped_column(Id)
    output_tokens: Mapped[int | None] = mapped_column(Id)
    cached_tokens: Mapped[int | None] = mapped_column(Id)
    cache_write_tokens: Mapped[int | None] = mapped_column(Id)
    counted_tokens: Mapped[int] = mapped_column(Id, nullable=False)
    estimated: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=false())
    counts_estimated: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=false())
    cost_nanousd: Mapped[int | None] = mapped_column(Id)
    created_at: Mapped[datetime] = _created()


class UsageTotal(Base):
    """What one account spent in one budget window, kept by the transaction that writes each
    ledger row, so a claim reads a few rows instead of summing the window's requests.

    ``account`` is ``user:…``, ``workspace:…`` or ``all``; ``period`` ``day`` or ``month``;
    ``window_start`` the window's first instant (UTC). ``tokens`` sums the requests'
    ``counted_tokens``, ``nanousd`` their known costs (``priced_requests`` of the
    ``requests``), ``output_tokens`` their reported output (a claim's expected output is the
    window's average).
    """

    __tablename__ = "usage_totals"

    account: Mapped[str] = mapped_column(String(300), primary_key=True)
    period: Mapped[str] = mapped_column(String(10), primary_key=True)
    window_start: Mapped[datetime] = mapped_column(UtcDateTime(), primary_key=True)
    tokens: Mapped[int] = mapped_column(Id, nullable=False)
    nanousd: Mapped[int] = mapped_column(Id, nullable=False)
    output_tokens: Mapped[int] = mapped_column(Id, nullable=False)
    requests: Mapped[int] = mapped_column(Id, nullable=False)
    priced_requests: Mapped[int] = mapped_column(Id, nullable=False)


class UsageReservation(Base):
    """What a running turn holds against its payer's budget accounts, taken in its claim
    transaction: one row per turn (per session), whatever the number of budgets.

    It counts only while its turn holds the session's lock (same ``lock_token``, live
    heartbeat): a turn that ends, dies or loses its lock stops holding it without a write, and
    the statement that releases or takes over the lock deletes it (a trigger on
    ``agent_sessions``, migrations 0007 and 0010). Replaced in place by the turn's later
    requests and by the session's next claim (``created_at``: when it was taken, by the
    claiming process's clock; what the turn's requests spent since is no longer held).

    One row, not one per account and unit: a turn's accounts are its payer's user
    (``user_account``), workspace (``workspace_account``) and everyone's, each held in tokens
    and in billionths of a dollar (``NULL``: no budget of that account and unit). Its rows
    inserted and deleted per turn were most of what budgets added to a turn on SQLite (pages
    of a table and two indexes written at the claim and again at the release); a claim reads
    every live turn's row (an ``all`` budget did already), so the table has no index but its
    key (docs/benchmarks.md, *The budget check at O(1)*, *Third pass*).
    """

    __tablename__ = "usage_reservations"

    session_id: Mapped[int] = mapped_column(
        Id,
        ForeignKey("agent_sessions.id", ondelete="CASCADE"),
        primary_key=True,
        autoincrement=False,
    )
    lock_token: Mapped[str] = mapped_column(String(36), nullable=False)
    created_at: Mapped[datetime] = _created()
    user_account: Mapped[str | None] = mapped_column(String(300))
    workspace_account: Mapped[str | None] = mapped_column(String(300))
    user_tokens: Mapped[int | None] = mapped_column(Id)
    user_nanousd: Mapped[int | None] = mapped_column(Id)
    workspace_tokens: Mapped[int | None] = mapped_column(Id)
    workspace_nanousd: Mapped[int | None] = mapped_column(Id)
    all_tokens: Mapped[int | None] = mapped_column(Id)
    all_nanousd: Mapped[int | None] = mapped_column(Id)


class ToolApproval(Base):
    """A tool call that waits for, or got, a person's decision (``core.storage.approvals``).

    ``digest`` names the exact call (tool and arguments, ``core.tools.call_digest``): an approval
    runs that call and nothing else. ``message_id`` is the assistant message whose tool part
    (``tool_call_id``) is in ``approval-requested``; a rewind that takes it out makes the request
    void. ``state``: ``pending`` -> ``approved`` | ``denied`` (a person; ``decided_by``) |
    ``expired`` | ``superseded`` (a new message) | ``rewound``; ``approved`` -> ``running`` (the
    call went to its server: it is never sent twice) -> ``done``; ``denied`` -> ``done``.
    ``card_ref`` is where a surface showed the request (a Slack message), to show the outcome.
    ``requested_by`` is the person whose message the model was answering when it asked (in a
    shared thread anyone may write, so not necessarily the session's owner); None on rows
    written before it was kept, which are shown as the owner's.
    """

    __tablename__ = "tool_approvals"
    __table_args__ = (Index(None, "session_id", "state"), Index(None, "state", "requested_at"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    session_id: Mapped[int] = mapped_column(
        Id, ForeignKey("agent_sessions.id", ondelete="CASCADE"), nullable=False
    )
    message_id: Mapped[str] = mapped_column(String(36), nullable=False)
    tool_call_id: Mapped[str] = mapped_column(String(255), nullable=False)
    tool_name: Mapped[str] = mapped_column(String(255), nullable=False)
    server: Mapped[str] = mapped_column(String(64), nullable=False)
    arguments: Mapped[dict[str, Any]] = mapped_column(ExactJson, nullable=False)
    digest: Mapped[str] = mapped_column(String(64), nullable=False)
    approvers: Mapped[list[str]] = mapped_column(JsonDoc, nullable=False)
    state: Mapped[str] = mapped_column(String(20), nullable=False)
    # Why a request ended where it did (``core.storage.approvals.Reason``); None while open.
    reason: Mapped[str | None] = mapped_column(String(40))
    requested_by: Mapped[str | None] = mapped_column(String(255))
    decided_by: Mapped[str | None] = mapped_column(String(255))
    # What the decider said with the decision (the API's ``reason``; at most
    # ``core.storage.approvals.DECISION_REASON_MOST`` characters); None when they said nothing.
    decision_reason: Mapped[str | None] = mapped_column(String(500))
    decided_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    card_ref: Mapped[str | None] = mapped_column(String(255))
    # The state the card last showed: a card whose request moved on elsewhere (the terminal
    # decided, it expired) is brought up to date by whichever replica sees the difference.
    card_state: Mapped[str | None] = mapped_column(String(20))
    requested_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class ApiToken(Base):
    """A program's key to the HTTP API (``slack-agent token create``): it acts as its person.
    Only a hash of the secret is kept, so a copy of the database opens nothing."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    user_id: Mapped[int] = mapped_column(
        Id, ForeignKey("users.id", ondelete="CASCADE"), nullable=False
    )
    name: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = _created()
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


class WebSession(Base):
    """A browser signed in with Slack: the cookie's value is the secret, only its hash is kept;
    it stops opening anything at ``expires_at`` or when its person signs out."""

    __tablename__ = "web_sessions"

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    cookie_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    user_id: Mapped[int] = mapped_column(
        Id, ForeignKey("users.id", ondelete="CASCADE"), nullable=False, index=True
    )
    created_at: Mapped[datetime] = _created()
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime(), nullable=False, index=True)
