"""Predicates and statements the session store's modules share (and the sweeper's predicate).

The lock predicates are defined once here, so "busy" means the same thing to a claim, a rewind,
a deletion, the sweeper and every surface polling ``is_turn_active``.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any, Final, NoReturn, cast

import orjson
from sqlalchemy import (
    CTE,
    Boolean,
    ColumnElement,
    Float,
    Insert,
    Integer,
    Row,
    Select,
    String,
    Table,
    Text,
    Update,
    and_,
    bindparam,
    case,
    false,
    func,
    insert,
    or_,
    select,
    true,
    type_coerce,
    update,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.exc import IntegrityError

from core.errors import (
    AgentSessionBusy,
    AgentSessionForbidden,
    AgentSessionNotFound,
    AgentSessionStale,
    DuplicateMessage,
    MessageNotFound,
    SlackAgentError,
)
from core.messages import Message
from core.records import Actor, SessionInfo, StoredMessage
from core.storage.dialect import ago, db_now
from core.storage.engine import Conn, Database, database_error, json_loads
from core.storage.models import (
    AgentSession,
    AgentSessionMessage,
    AgentSessionSnapshot,
    Id,
    MessageDoc,
    User,
    validate_message,
)
from core.storage.prepared import Prepared

SESSIONS: Final = cast(Table, AgentSession.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
SNAPSHOTS: Final = cast(Table, AgentSessionSnapshot.__table__)
USERS: Final = cast(Table, User.__table__)

AnyRow = Row[*tuple[Any, ...]]

MESSAGE_COLUMNS: Final = (
    MESSAGES.c.message_id,
    MESSAGES.c.position,
    MESSAGES.c.message,
    MESSAGES.c.is_compaction_message,
)


def turn_active(staleness_seconds: float) -> ColumnElement[bool]:
    """The single definition of "a turn is active": a heartbeat within the staleness window."""
    return and_(
        SESSIONS.c.heartbeat_at.is_not(None),
        SESSIONS.c.heartbeat_at >= ago(staleness_seconds),
    )


def claimable(staleness_seconds: float) -> ColumnElement[bool]:
    """The negation of ``turn_active``, written so it can sit in an UPDATE's WHERE clause."""
    return or_(
        SESSIONS.c.heartbeat_at.is_(None),
        SESSIONS.c.heartbeat_at < ago(staleness_seconds),
    )


# The columns a ``SessionInfo`` is read from: all but the tail the stale guard compares,
# which only the claim's statements read.
SESSION_FIELDS: Final = tuple(c for c in SESSIONS.c if c.name != "tail_message_id")


def session_select(staleness_seconds: float) -> Select[Any]:
    return select(
        *SESSION_FIELDS,
        type_coerce(turn_active(staleness_seconds), Boolean).label("is_turn_active"),
    )


def session_info(row: AnyRow) -> SessionInfo:
    return SessionInfo(
        id=row.id,
        project_name=row.project_name,
        project_session_id=row.project_session_id,
        user_id=row.user_id,
        title=row.title,
        expires_at=row.expires_at,
        heartbeat_at=row.heartbeat_at,
        model_provider=row.model_provider,
        model_name=row.model_name,
        custom_provider_id=row.custom_provider_id,
        builtin_provider=row.builtin_provider,
        created_at=row.created_at,
        updated_at=row.updated_at,
        is_turn_active=bool(row.is_turn_active),
    )


def stored(row: AnyRow) -> StoredMessage:
    return StoredMessage(
        message_id=row.message_id,
        position=row.position,
        message=row.message,
        is_compaction_message=bool(row.is_compaction_message),
    )


def without_nul(value: Any) -> Any:
    """``value`` with every NUL in its strings replaced (U+FFFD). PostgreSQL cannot store NUL
    in JSONB or text, and a model, a command's output or a person can produce one: a turn
    must not fail to be stored for it."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {k: without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value


def message_row(
    session_id: int, position: int, message: Message, *, compaction: bool = False
) -> dict[str, Any]:
    """The one way a message becomes a row: its id is checked and ``message_id`` derived."""
    return {
        "session_id": session_id,
        "position": position,
        "message": without_nul(message),
        "message_id": validate_message(message),
        "is_compaction_message": compaction,
    }


def history_statement(session_id: Any) -> Select[Any]:
    """The projection as one query whose cost follows the projected size, not the history.

    Both bounds are index seeks (the latest checkpoint and the tail), and the range between them
    is scanned on ``(session_id, position)``. The upper bound is redundant for correctness; it
    is there so PostgreSQL's planner sees a bounded range (it estimates an open-ended
    ``position >= $1`` at a third of the table and would scan the whole session).
    """

    def latest(*conditions: ColumnElement[bool]) -> Any:
        return (
            select(func.max(MESSAGES.c.position))
            .where(MESSAGES.c.session_id == session_id, *conditions)
            .scalar_subquery()
        )

    return (
        select(*MESSAGE_COLUMNS)
        .where(
            MESSAGES.c.session_id == session_id,
            MESSAGES.c.position.between(
                func.coalesce(latest(MESSAGES.c.is_compaction_message == true()), 0), latest()
            ),
        )
        .order_by(MESSAGES.c.position)
    )


_HISTORY: Final = Prepared(
    history_statement(bindparam("sid", type_=Id)).with_only_columns(
        MESSAGES.c.position, sa_cast(MESSAGES.c.message, Text), MESSAGES.c.is_compaction_message
    )
)


async def history(db: Database, session_id: int) -> list[StoredMessage]:
    """The model's view (``history_statement``), made for speed: a history grows with the
    conversation, and at 10,000 messages SQLAlchemy's per-row work, the standard library's
    JSON decoder and a frozen dataclass per message were most of a load's time
    (docs/benchmarks.md, *History load of 10,000 messages*). So the rows come as plain
    values, read by one statement on its own (``Prepared.fetch``: on SQLite from the reader
    connection's cursor, on PostgreSQL on a held connection), each message's JSON is
    decoded by orjson (``json_loads``), and its id is read from the message (``message_id``
    equals ``message["id"]``, checked by ``validate_message`` on every write).

    The garbage collector is paused while the messages are built: each is five new
    containers that all live on, so a collection meanwhile can free nothing, yet at 10,000
    messages the collections it triggered (a full one every second load or so, walking the
    whole heap) doubled the load's median time. Paused only for that synchronous loop, never
    across an ``await``, so no other task runs with it paused.

    The loop is the load's own cost, so it calls C directly: orjson (``json_loads`` only for
    what orjson refuses) and ``tuple.__new__`` (a named tuple's ``__new__`` is Python)."""
    rows = await _HISTORY.fetch(db, {"sid": session_id}, raw=True)
    loads = orjson.loads
    new = tuple.__new__
    flags = (False, True)  # SQLite gives 0 or 1, asyncpg a bool: both index it
    found: list[StoredMessage] = []
    add = found.append
    collecting = gc.isenabled()
    gc.disable()
    try:
        for position, text, compaction in rows:
            try:
                message = loads(text)
            except orjson.JSONDecodeError:
                message = json_loads(text)
            add(new(StoredMessage, (message["id"], position, message, flags[compaction])))
    finally:
        if collecting:
            gc.enable()
    return found


async def tail(conn: Conn, session_id: int) -> StoredMessage | None:
    rows = await _TAIL.rows(conn, {"sid": session_id})
    return stored(rows[0]) if rows else None


async def read_tail(db: Database, session_id: int) -> StoredMessage | None:
    """The tail as a read of its own (``Prepared.fetch``)."""
    rows = await _TAIL.fetch(db, {"sid": session_id})
    return stored(rows[0]) if rows else None


async def message_in(conn: Conn, session_id: int, message_id: str) -> StoredMessage:
    row = (
        await conn.execute(
            select(*MESSAGE_COLUMNS).where(
                MESSAGES.c.session_id == session_id, MESSAGES.c.message_id == message_id
            )
        )
    ).first()
    if row is None:
        raise MessageNotFound(f"message {message_id} is not in session {session_id}")
    return stored(row)


def message_integrity_error(exc: IntegrityError) -> SlackAgentError:
    """What a failed message insert means: ``DuplicateMessage`` only when the message's id is
    already stored (a retried delivery); any other constraint (a position already taken, a
    session that is gone) is a ``DatabaseError`` naming it, never "already stored"."""
    detail = str(exc.orig)
    # SQLite: "UNIQUE constraint failed: agent_session_messages.message_id"; PostgreSQL:
    # 'duplicate key value violates unique constraint "uq_agent_session_messages_message_id"'.
    if "agent_session_messages.message_id" in detail or _MESSAGE_ID_UNIQUE in detail:
        return DuplicateMessage(f"a message with this id is already stored: {detail}")
    return database_error(exc)


_MESSAGE_ID_UNIQUE: Final = "uq_agent_session_messages_message_id"


_INSERT_ONE: Final = Prepared(
    insert(MESSAGES).values(
        session_id=bindparam("session_id", type_=Id),
        position=bindparam("position", type_=Integer()),
        message=bindparam("message", type_=MessageDoc),
        message_id=bindparam("message_id", type_=String(36)),
        is_compaction_message=bindparam("is_compaction_message", type_=Boolean()),
    )
)


async def insert_messages(conn: Conn, rows: list[dict[str, Any]]) -> None:
    """Insert ``message_row`` rows (one, a turn's answer, the usual case: prepared)."""
    try:
        if len(rows) == 1:
            await _INSERT_ONE.run(conn, rows[0])
        else:
            await conn.execute(insert(MESSAGES), rows)
    except IntegrityError as exc:
        raise message_integrity_error(exc) from exc


# -- the turn's hot path, built once with bind parameters ---------------------------------------
# Building a statement costs more than SQLite takes to run it; these are built at import and
# executed with parameters. Names: sid, token, staleness, title, abandoned, provider, model_name,
# custom_provider_id, builtin_provider; and for a fenced row p_position, p_message, p_message_id,
# p_compaction.

_LIVE_BOUNDARY = db_now(-bindparam("staleness", type_=Float()))
# ``turn_active`` with the staleness window a bind parameter (``staleness``), for statements
# built once.
TURN_ACTIVE_BOUND: Final = and_(
    SESSIONS.c.heartbeat_at.is_not(None), SESSIONS.c.heartbeat_at >= _LIVE_BOUNDARY
)


def tail_is_seen() -> ColumnElement[bool]:
    """The stale guard as a predicate on the session's row: its tail (``tail_message_id``) is
    the one the client last saw (``last``; NULL: an empty session), or the claim takes any
    tail (``any_tail``: compaction, a resume). On the row, not a subquery on the messages:
    a PostgreSQL UPDATE that waited on the row's lock re-checks its WHERE on the row's newest
    version (EvalPlanQual), while a subquery keeps the statement's older snapshot, so an
    answer committed meanwhile would be missed (migration 0011)."""
    return or_(
        bindparam("any_tail", type_=Boolean()),
        SESSIONS.c.tail_message_id.is_not_distinct_from(bindparam("last", type_=String(36))),
    )


def claim_statement(*, stamp: bool) -> Update:
    """The claim (see docs/design.md, *The turn protocol*): the lock taken if it is free,
    stale or this process's own abandoned one, and the tail the client saw (``tail_is_seen``)
    still the tail; the tail moved to the turn's user message (``new_tail``; NULL: none is
    stored). Parameters: sid, token, takeover_token, staleness, title, abandoned, any_tail,
    last, new_tail, and with ``stamp`` the model's."""
    values: dict[str, Any] = {
        "heartbeat_at": db_now(),
        # The token says whether the lock was free or taken over from a turn that stopped
        # heartbeating (its token was never cleared): SET sees the old row on both databases.
        "lock_token": case(
            (SESSIONS.c.lock_token.is_(None), bindparam("token", type_=String())),
            else_=bindparam("takeover_token", type_=String()),
        ),
        "updated_at": db_now(),
        "title": func.coalesce(SESSIONS.c.title, bindparam("title", type_=String())),
        "tail_message_id": func.coalesce(
            bindparam("new_tail", type_=String(36)), SESSIONS.c.tail_message_id
        ),
    }
    if stamp:  # stamp_session_model
        values.update(
            model_provider=bindparam("provider", type_=String()),
            model_name=bindparam("model_name", type_=String()),
            custom_provider_id=bindparam("custom_provider_id", type_=Id),
            builtin_provider=bindparam("builtin_provider", type_=String()),
        )
    return (
        update(SESSIONS)
        .where(
            SESSIONS.c.id == bindparam("sid", type_=Id),
            or_(
                SESSIONS.c.heartbeat_at.is_(None),
                SESSIONS.c.heartbeat_at < _LIVE_BOUNDARY,
                # A lock this process's own turn left set when the database went away
                # (``SessionStore.abandon``); NULL, which matches nothing, otherwise.
                SESSIONS.c.lock_token == bindparam("abandoned", type_=String()),
            ),
            tail_is_seen(),
        )
        .values(values)
    )


# Where the database has RETURNING (PostgreSQL; SQLite from 3.35, see
# ``core.storage.engine.MIN_SQLITE``) the claim returns the token it set; an older SQLite reads it
# back in the same write transaction, which no other writer can interleave with.
_CLAIMS: Final = {
    (stamp, returning): Prepared(
        claim_statement(stamp=stamp).returning(SESSIONS.c.lock_token)
        if returning
        else claim_statement(stamp=stamp)
    )
    for stamp in (False, True)
    for returning in (False, True)
}
_TOKEN: Final = Prepared(
    select(SESSIONS.c.lock_token).where(SESSIONS.c.id == bindparam("sid", type_=Id))
)


async def claim(conn: Conn, params: dict[str, Any], *, stamp: bool) -> str | None:
    """The claim (``claim_statement``) in the caller's transaction: the new fencing token, or
    None when it was refused (``read_refusal`` says why)."""
    if conn.dialect.update_returning:
        row = (await _CLAIMS[stamp, True].run(conn, params)).row
        return None if row is None else str(row[0])
    if not (await _CLAIMS[stamp, False].run(conn, params)).rowcount:
        return None
    token = (await _TOKEN.run(conn, {"sid": params["sid"]})).row
    assert token is not None  # the claim just updated this row, in this transaction
    return str(token[0])


_TAIL: Final = Prepared(
    select(*MESSAGE_COLUMNS)
    .where(MESSAGES.c.session_id == bindparam("sid", type_=Id))
    .order_by(MESSAGES.c.position.desc())
    .limit(1)
)


def _next_position(sid: Any) -> Any:
    return (
        select(func.coalesce(func.max(MESSAGES.c.position) + 1, 0))
        .where(MESSAGES.c.session_id == sid)
        .scalar_subquery()
    )


_USER_COLUMNS: Final = ["session_id", "position", "message", "message_id", "is_compaction_message"]


def insert_next_statement() -> Insert:
    """The turn's user message at the session's next position. Runs after the claim, which
    checked the tail (``tail_is_seen``) and moved it to this message, in the same transaction:
    the claim holds the session, so nobody appends between the two."""
    sid = bindparam("sid", type_=Id)
    return insert(MESSAGES).from_select(
        _USER_COLUMNS,
        select(
            sid,
            _next_position(sid),
            bindparam("p_message", type_=MessageDoc),
            bindparam("p_message_id", type_=String(36)),
            false(),
        ),
    )


INSERT_NEXT: Final = {
    True: Prepared(insert_next_statement().returning(MESSAGES.c.position)),
    False: Prepared(insert_next_statement()),  # SQLite before 3.35: no RETURNING
}
_POSITION_OF: Final = Prepared(
    select(MESSAGES.c.position).where(
        MESSAGES.c.message_id == bindparam("p_message_id", type_=String(36))
    )
)


def user_params(row: dict[str, Any]) -> dict[str, Any]:
    """The parameters that store ``row`` (a ``message_row``; its position is chosen by the
    statement) as a turn's user message: in the claim (``claim_statement``, which makes it
    the tail) and its insert."""
    return {
        "sid": row["session_id"],
        "p_message": row["message"],
        "p_message_id": row["message_id"],
        "new_tail": row["message_id"],
    }


async def insert_next(conn: Conn, row: dict[str, Any]) -> int:
    """Insert ``row`` at the session's next position (``insert_next_statement``), after the
    claim in its transaction; the position it got."""
    params = user_params(row)
    try:
        if conn.dialect.insert_returning:
            position = (await INSERT_NEXT[True].run(conn, params)).row
        else:
            await INSERT_NEXT[False].run(conn, params)
            position = (await _POSITION_OF.run(conn, params)).row
    except IntegrityError as exc:
        raise message_integrity_error(exc) from exc
    assert position is not None
    return int(position[0])


def claimed_cte(*, stamp: bool, only_if: ColumnElement[bool] | None = None) -> CTE:
    """The claim (``claim_statement``) as a CTE returning the session's id and the token it
    set, for a statement that inserts the user message from it (``insert_claimed``).
    ``only_if``: a further condition, such as a budget's admission (``core.storage.
    reservations``): the claim changes nothing unless it holds too."""
    claim = claim_statement(stamp=stamp)
    if only_if is not None:
        claim = claim.where(only_if)
    return claim.returning(SESSIONS.c.id, SESSIONS.c.lock_token).cte("claimed")


def insert_claimed(claimed: CTE) -> Insert:
    """The user message inserted from ``claimed`` (``claimed_cte``), nothing when the claim
    changed nothing; returns the message's position and the claim's token."""
    return (
        insert(MESSAGES)
        .from_select(
            _USER_COLUMNS,
            select(
                claimed.c.id,
                _next_position(bindparam("sid", type_=Id)),
                bindparam("p_message", type_=MessageDoc),
                bindparam("p_message_id", type_=String(36)),
                false(),
            ),
        )
        .returning(MESSAGES.c.position, select(claimed.c.lock_token).scalar_subquery())
    )


def claim_inserting_statement(*, stamp: bool) -> Insert:
    """PostgreSQL: the claim (``claim_statement``, the stale guard in it) and the user
    message's insert as one statement, so a turn's opening is one round trip, autocommitted,
    instead of four (BEGIN, the claim, the guarded insert, COMMIT). The claim runs in a CTE
    and the insert takes its row from it, inserting nothing when the claim changed nothing;
    it returns the message's position and the token the claim set.

    Safe because the guard is on the session's row: if the claim waits on the row's lock
    while a release appends the answer, PostgreSQL re-checks the claim's WHERE, the tail
    included, on the row the release committed. The next position is read from the
    statement's snapshot: a write that commits after it and leaves the claim's WHERE true
    appended nothing (every append moves the tail), and were that ever not so the
    ``(session_id, position)`` unique constraint would refuse the insert, never misplace it."""
    return insert_claimed(claimed_cte(stamp=stamp))


CLAIM_INSERTING: Final = {
    stamp: Prepared(claim_inserting_statement(stamp=stamp)) for stamp in (False, True)
}


async def claim_inserting(
    conn: Conn, params: dict[str, Any], *, stamp: bool
) -> tuple[str, int] | None:
    """``claim_inserting_statement``: the token and the user message's position, or None
    when the claim was refused (``refusal`` says why)."""
    try:
        row = (await CLAIM_INSERTING[stamp].run(conn, params)).row
    except IntegrityError as exc:
        raise message_integrity_error(exc) from exc
    return None if row is None else (str(row[1]), int(row[0]))


_REFUSAL: Final = Prepared(
    select(
        SESSIONS.c.lock_token,
        type_coerce(TURN_ACTIVE_BOUND, Boolean).label("live"),
        SESSIONS.c.tail_message_id,
    ).where(SESSIONS.c.id == bindparam("sid", type_=Id))
)


class ClaimMissed(Exception):
    """A refused claim whose reason was gone by the time it was read (the lock went stale, or
    was released without an answer): the claim may be tried again."""


def refusal(
    session_id: int, found: Sequence[Any], params: dict[str, Any]
) -> SlackAgentError | ClaimMissed:
    """Why a claim with ``params`` changed nothing, from the session's row as ``_REFUSAL`` read
    it after the claim: gone, busy (a live lock not this process's abandoned one) before
    stale (the tail is not the one the client saw, named in the error)."""
    if not found:
        return AgentSessionNotFound(f"session {session_id} does not exist")
    token, live, tail_id = found[0]
    if live and (token is None or token != params["abandoned"]):
        return AgentSessionBusy(f"session {session_id} has a turn in progress")
    if not params["any_tail"] and tail_id != params["last"]:
        return AgentSessionStale(
            f"session {session_id} has moved on: its last message is {tail_id}, "
            f"not {params['last']}",
            actual_last_message_id=tail_id,
        )
    return ClaimMissed()


async def read_refusal(
    conn: Conn, session_id: int, params: dict[str, Any]
) -> SlackAgentError | ClaimMissed:
    """``refusal`` read in the claim's own transaction."""
    found = await _REFUSAL.rows(conn, {"sid": session_id, "staleness": params["staleness"]})
    return refusal(session_id, found, params)


async def fetch_refusal(
    db: Database, session_id: int, params: dict[str, Any]
) -> SlackAgentError | ClaimMissed:
    """``refusal`` read on its own, after a claim that ran on its own (``claim_inserting``)."""
    found = await _REFUSAL.fetch(db, {"sid": session_id, "staleness": params["staleness"]})
    return refusal(session_id, found, params)


_SET_TAIL: Final = Prepared(
    update(SESSIONS)
    .where(SESSIONS.c.id == bindparam("sid", type_=Id))
    .values(
        tail_message_id=select(MESSAGES.c.message_id)
        .where(MESSAGES.c.session_id == bindparam("sid", type_=Id))
        .order_by(MESSAGES.c.position.desc())
        .limit(1)
        .scalar_subquery()
    )
)


async def set_tail(conn: Conn, session_id: int) -> None:
    """Move the session's ``tail_message_id`` to its last message, for the writes that remove
    messages or add many outside a turn (a rewind, a fork, an import), in their transaction,
    after them (they hold the session's row or created it)."""
    await _SET_TAIL.run(conn, {"sid": session_id})


def _fence(*, release: bool, moving: bool = False) -> Update:
    """The fenced UPDATE; ``moving``: messages are appended behind it, the last of them
    (``p_message_id``) becomes the session's tail (``tail_message_id``)."""
    values: dict[str, Any] = {"updated_at": db_now()}
    if moving:
        values["tail_message_id"] = bindparam("p_message_id", type_=String(36))
    if release:
        values.update(heartbeat_at=None, lock_token=None)
    else:
        values["heartbeat_at"] = db_now()
    return (
        update(SESSIONS)
        .where(
            SESSIONS.c.id == bindparam("sid", type_=Id),
            SESSIONS.c.lock_token == bindparam("token", type_=String()),
        )
        .values(values)
    )


def _fenced_insert(fence: Update) -> Insert:
    """PostgreSQL: insert one message only if ``fence`` changed the session's row.

    One statement, so no transaction round trips: the UPDATE runs in a CTE and the INSERT takes
    its row from it, inserting nothing when the fencing token no longer matches.
    """
    fenced = fence.returning(SESSIONS.c.id).cte("fenced")
    return insert(MESSAGES).from_select(
        ["session_id", "position", "message", "message_id", "is_compaction_message"],
        select(
            fenced.c.id,
            bindparam("p_position", type_=Integer()),
            bindparam("p_message", type_=MessageDoc),
            bindparam("p_message_id", type_=String(36)),
            bindparam("p_compaction", type_=Boolean()),
        ),
    )


FENCE: Final = {release: Prepared(_fence(release=release)) for release in (False, True)}
FENCE_MOVING: Final = {
    release: Prepared(_fence(release=release, moving=True)) for release in (False, True)
}
FENCED_INSERT: Final = {
    release: Prepared(_fenced_insert(_fence(release=release, moving=True)))
    for release in (False, True)
}


async def fence(
    conn: Conn, lease_params: dict[str, Any], *, release: bool, tail: str | None = None
) -> bool:
    """Refresh the turn's heartbeat, or release its lock, if the token is still the session's;
    False when it is not (the turn's lock was taken over or released). ``tail``: the id of the
    last message the caller appends next, in this transaction (the session's new tail)."""
    if tail is None:
        return bool((await FENCE[release].run(conn, lease_params)).rowcount)
    params = {**lease_params, "p_message_id": tail}
    return bool((await FENCE_MOVING[release].run(conn, params)).rowcount)


async def fenced_insert(
    conn: Conn, lease_params: dict[str, Any], row: dict[str, Any], *, release: bool
) -> int:
    """One message behind the fence, in one statement; returns 0 if the fence refused it."""
    params = {
        **lease_params,
        "p_position": row["position"],
        "p_message": row["message"],
        "p_message_id": row["message_id"],
        "p_compaction": row["is_compaction_message"],
    }
    try:
        return (await FENCED_INSERT[release].run(conn, params)).rowcount
    except IntegrityError as exc:
        raise message_integrity_error(exc) from exc


async def append_messages(
    conn: Conn, session_id: int, start: int, messages: Sequence[tuple[Message, bool]]
) -> list[StoredMessage]:
    """Insert ``(message, is_checkpoint)`` pairs from position ``start`` on."""
    rows = [
        message_row(session_id, start + i, message, compaction=compaction)
        for i, (message, compaction) in enumerate(messages)
    ]
    if rows:
        await insert_messages(conn, rows)
    return [
        StoredMessage(r["message_id"], r["position"], r["message"], r["is_compaction_message"])
        for r in rows
    ]


async def next_position(conn: Conn, session_id: int) -> int:
    last = await conn.scalar(
        select(func.max(MESSAGES.c.position)).where(MESSAGES.c.session_id == session_id)
    )
    return 0 if last is None else int(last) + 1


async def check_owner(conn: Conn, session_id: int, actor: Actor) -> None:
    owner = (
        await conn.execute(select(SESSIONS.c.user_id).where(SESSIONS.c.id == session_id))
    ).first()
    if owner is None:
        raise AgentSessionNotFound(f"session {session_id} does not exist")
    if not actor.may_manage(owner.user_id):
        raise AgentSessionForbidden(
            f"only the session's owner or an admin may change session {session_id}"
        )


async def raise_missing_or_busy(conn: Conn, session_id: int) -> NoReturn:
    """Explain why a conditional UPDATE on a session changed nothing."""
    exists = await conn.scalar(select(SESSIONS.c.id).where(SESSIONS.c.id == session_id))
    if exists is None:
        raise AgentSessionNotFound(f"session {session_id} does not exist")
    raise AgentSessionBusy(f"session {session_id} has a turn in progress")
