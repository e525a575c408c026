"""Per-message sandbox snapshots in SQL: every statement on the snapshot tables.

Layout. ``snapshot_contents`` holds bashkit snapshot objects, one row per object id, so equal
content is stored once across messages, sessions and forks. ``snapshot_sets`` are
content-addressed sets of objects whose membership is rows (``snapshot_set_members``). A
snapshot (``agent_session_snapshots``, one per message with sandbox state) names the commit to
check out and two sets whose union holds every object of that state: a *base* set shared with
the snapshots before and after it, and a small *delta* set of what is not in the base. A turn
therefore adds its new objects (usually a few hundred bytes of deltas, see ``core.sandbox.shell``),
a delta set of a few dozen 16-byte memberships, and its snapshot row; a new base is written when the
delta set outgrows it (about every dozen messages for a 1 MB workspace).

Restoring a message's state is one SELECT: the snapshot row picked by position, the members of
its two sets, their content, and each delta's base (at most one level; see ``SnapshotContent``).
No chain is replayed.

Writing happens in two steps so that no lock is held while bytes move: ``store_content`` writes
objects and sets in their own short transaction, idempotently, before the turn ends;
``attach_snapshot`` adds the small snapshot row inside the fenced transaction that persists the
assistant message. Between the two, the new sets are named by no snapshot: the sweeper's grace
period (``CONTENT_GRACE_SECONDS``) protects them, and through their members the content. A
writer that reuses a row or set past half its grace period refreshes its ``created_at`` in the
same transaction; the sweeper's DELETE re-checks every condition row by row, so it either sees
the refreshed row and skips it, or deleted it first and the writer, finding it gone, stores it
again. A base set read back with a state needs nothing: the snapshot it came from names it, and
that snapshot stays while the turn holds its session's lock (rewinds and deletions wait).

Garbage collection is SQL only: sets no snapshot names, then content that no set contains and no
delta uses as its base (a base goes in the round after its last delta), all past the grace
period, in batches, each DELETE re-checking its condition row by row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

from sqlalchemy import (
    ColumnElement,
    Table,
    and_,
    bindparam,
    exists,
    func,
    insert,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import aliased
from sqlalchemy.sql.elements import BindParameter

from core.errors import DatabaseError
from core.sandbox.state import (
    Captured,
    NewObject,
    SandboxState,
    SetRef,
    StoredObject,
)
from core.storage.batched import delete_in_batches
from core.storage.dialect import ago, db_now
from core.storage.engine import Conn, Database
from core.storage.models import (
    AgentSessionMessage,
    AgentSessionSnapshot,
    Id,
    SnapshotContent,
    SnapshotSet,
    SnapshotSetMember,
)
from core.storage.prepared import Prepared

CONTENTS: Final = cast(Table, SnapshotContent.__table__)
SETS: Final = cast(Table, SnapshotSet.__table__)
MEMBERS: Final = cast(Table, SnapshotSetMember.__table__)
SNAPSHOTS: Final = cast(Table, AgentSessionSnapshot.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
SNAPSHOT_TABLES: Final = (CONTENTS, SETS, MEMBERS, SNAPSHOTS)

# Unreferenced content younger than this is never collected: a turn may be between storing
# content and attaching the snapshot that refers to it.
CONTENT_GRACE_SECONDS = 3600.0
# Bind parameters per IN list: far below both drivers' limits.
_IN_CHUNK: Final = 500

# Logical bytes of a row, counted the same way everywhere (``stored_size``, the benchmark):
# every fixed-width column (ids, sizes, timestamps) as 8 bytes, text and bytes at their length.
CONTENT_FIXED_BYTES: Final = 5 * 8  # id, base_id, raw_size, stored_size, created_at
SET_FIXED_BYTES: Final = 3 * 8  # id, size, created_at
MEMBER_BYTES: Final = 2 * 8  # set_id, content_id
SNAPSHOT_FIXED_BYTES: Final = 7 * 8  # id, session_id, 2 set ids, 2 sizes, created_at


@dataclass(frozen=True)
class SnapshotRef:
    """What ``store_content`` wrote, for ``attach_snapshot`` to point a message at."""

    commit: str
    base_set_id: int
    delta_set_id: int | None
    raw_size: int
    stored_size: int


def _chunks(items: Sequence[str]) -> Iterable[list[str]]:
    for start in range(0, len(items), _IN_CHUNK):
        yield list(items[start : start + _IN_CHUNK])


def _content_bytes(obj: NewObject) -> int:
    return len(obj.data) + len(obj.digest) + len(obj.codec) + CONTENT_FIXED_BYTES


# -- writing ----------------------------------------------------------------------------------
# Statements are built once: a turn's snapshot runs a handful of them, and building and
# compiling a statement costs more than SQLite takes to run it.

_REFRESH_BEFORE: Final = ago(CONTENT_GRACE_SECONDS / 2)
_EXISTING: Final = select(
    CONTENTS.c.digest,
    CONTENTS.c.base_id.is_not(None).label("is_delta"),
    (CONTENTS.c.created_at < _REFRESH_BEFORE).label("aging"),
).where(CONTENTS.c.digest.in_(bindparam("digests", expanding=True)))
_REFRESH_CONTENT: Final = (
    update(CONTENTS)
    .where(CONTENTS.c.digest.in_(bindparam("digests", expanding=True)))
    .values(created_at=db_now())
)
_STORED_DIGESTS: Final = select(CONTENTS.c.digest).where(
    CONTENTS.c.digest.in_(bindparam("digests", expanding=True))
)
_FIND_SET: Final = select(SETS.c.id, (SETS.c.created_at < _REFRESH_BEFORE).label("aging")).where(
    SETS.c.digest == bindparam("p_digest")
)
_REFRESH_SET: Final = update(SETS).where(SETS.c.id == bindparam("p_id")).values(created_at=db_now())
_ADD_MEMBERS: Final = insert(MEMBERS).from_select(
    ["set_id", "content_id"],
    select(bindparam("p_set", type_=MEMBERS.c.set_id.type), CONTENTS.c.id).where(
        CONTENTS.c.digest.in_(bindparam("digests", expanding=True))
    ),
)


def _insert_contents(dialect: str) -> Any:
    """INSERT of content rows that upgrades a stored delta to self-contained, never the reverse
    (see ``SnapshotContent``); a self-contained row already there is left as it is."""
    base = aliased(CONTENTS)
    stmt = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(CONTENTS).values(
        digest=bindparam("p_digest"),
        codec=bindparam("p_codec"),
        base_id=select(base.c.id).where(base.c.digest == bindparam("p_base")).scalar_subquery(),
        raw_size=bindparam("p_raw_size"),
        stored_size=bindparam("p_stored_size"),
        data=bindparam("p_data"),
    )
    return stmt.on_conflict_do_update(
        index_elements=[CONTENTS.c.digest],
        set_={
            "codec": stmt.excluded.codec,
            "base_id": stmt.excluded.base_id,
            "stored_size": stmt.excluded.stored_size,
            "data": stmt.excluded.data,
            "created_at": db_now(),
        },
        where=and_(CONTENTS.c.base_id.is_not(None), stmt.excluded.base_id.is_(None)),
    )


def _insert_set(dialect: str) -> Any:
    insert_ = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = (
        insert_(SETS)
        .values(digest=bindparam("p_digest"), size=bindparam("p_size"))
        .on_conflict_do_nothing(index_elements=[SETS.c.digest])
    )
    # SQLite: no RETURNING before 3.35; the new row's id is the cursor's lastrowid.
    return stmt.returning(SETS.c.id) if dialect == "postgresql" else stmt


_INSERT_CONTENTS: Final = {d: _insert_contents(d) for d in ("postgresql", "sqlite")}
_INSERT_SET: Final = {d: _insert_set(d) for d in ("postgresql", "sqlite")}


async def store_content(db: Database, captured: Captured) -> SnapshotRef:
    """Write a captured state's objects and sets; idempotent, in its own short transaction.

    Run it before the fenced transaction that ends the turn (``attach_snapshot`` goes there),
    not inside it: the turn's lock then never waits on bytes being written.
    """
    async with db.write() as conn:
        stored = await _store_objects(conn, captured.objects)
        base_set_id, base_bytes = await _store_set(conn, captured.base_set)
        delta_set_id: int | None = None
        delta_bytes = 0
        if captured.delta_set is not None:
            delta_set_id, delta_bytes = await _store_set(conn, captured.delta_set)
    return SnapshotRef(
        commit=captured.commit,
        base_set_id=base_set_id,
        delta_set_id=delta_set_id,
        raw_size=captured.raw_size,
        stored_size=stored + base_bytes + delta_bytes,
    )


async def _store_objects(conn: Conn, objects: Sequence[NewObject]) -> int:
    """Insert the objects not stored yet; returns the bytes added.

    An object already stored is reused as it is, with two exceptions: one near the end of its
    grace period is refreshed (see the module docstring), and one stored as a delta is rewritten
    self-contained when this capture has it so, because this sandbox may use it as a base.
    """
    if not objects:
        return 0
    wanted = {obj.digest: obj for obj in objects}
    existing: dict[str, tuple[bool, bool]] = {}
    for chunk in _chunks(list(wanted)):
        rows = await conn.execute(_EXISTING, {"digests": chunk})
        existing.update({r.digest: (bool(r.is_delta), bool(r.aging)) for r in rows})

    to_write = [
        obj
        for obj in objects
        if obj.digest not in existing or (existing[obj.digest][0] and obj.base_digest is None)
    ]
    writing = {obj.digest for obj in to_write}
    aging = [d for d, (_, old) in existing.items() if old and d not in writing]
    for chunk in _chunks(aging):
        refreshed = await _refresh_contents(conn, chunk)
        # Collected between our SELECT and this UPDATE: store it again.
        to_write += [wanted[d] for d in chunk if d not in refreshed]
    if not to_write:
        return 0
    await conn.execute(
        _INSERT_CONTENTS[conn.dialect.name],
        [
            {
                "p_digest": obj.digest,
                "p_codec": obj.codec,
                "p_base": obj.base_digest,
                "p_raw_size": obj.raw_size,
                "p_stored_size": len(obj.data),
                "p_data": obj.data,
            }
            for obj in to_write
        ],
    )
    return sum(_content_bytes(obj) for obj in to_write)


async def _store_set(conn: Conn, ref: SetRef) -> tuple[int, int]:
    """The id of a set, written with its members unless it exists; and the bytes added.

    Inserting first: a message's delta set is almost always new (and a base set read back
    with the state already has its id).
    """
    if ref.id is not None:
        return ref.id, 0  # read back with the state this sandbox was restored from
    for _ in range(2):
        result = await conn.execute(
            _INSERT_SET[conn.dialect.name], {"p_digest": ref.digest, "p_size": len(ref.members)}
        )
        if conn.dialect.name == "postgresql":
            created = result.scalar()
        else:
            created = result.lastrowid if result.rowcount == 1 else None
        if created is not None:
            return int(created), await _add_members(conn, int(created), ref)
        found = (await conn.execute(_FIND_SET, {"p_digest": ref.digest})).first()
        if found is None:
            continue  # collected between the two statements: create it again
        if not found.aging:
            return int(found.id), 0
        if (await conn.execute(_REFRESH_SET, {"p_id": found.id})).rowcount:
            return int(found.id), 0
    raise DatabaseError(f"snapshot set {ref.digest} keeps disappearing while being stored")


async def _refresh_contents(conn: Conn, digests: list[str]) -> set[str]:
    """Refresh the grace period of these content rows; the digests that were still there."""
    params = {"digests": digests}
    if conn.dialect.name == "postgresql":
        return set(
            (await conn.execute(_REFRESH_CONTENT.returning(CONTENTS.c.digest), params)).scalars()
        )
    # SQLite (no RETURNING before 3.35): read, then update, under the same write lock.
    found = set((await conn.execute(_STORED_DIGESTS, params)).scalars())
    await conn.execute(_REFRESH_CONTENT, params)
    return found


async def _add_members(conn: Conn, set_id: int, ref: SetRef) -> int:
    added = 0
    for chunk in _chunks(sorted(ref.members)):
        result = await conn.execute(_ADD_MEMBERS, {"p_set": set_id, "digests": chunk})
        added += result.rowcount
    if added != len(ref.members):
        raise DatabaseError(
            f"snapshot set {ref.digest}: {len(ref.members) - added} of its objects are not "
            "stored (was the sandbox's previous capture never stored?)"
        )
    return len(ref.digest) + SET_FIXED_BYTES + MEMBER_BYTES * added


async def attach_snapshot(
    conn: Conn, *, session_id: int, message_id: str, ref: SnapshotRef
) -> None:
    """Point a message at a stored state, inside the caller's (fenced) transaction."""
    row_bytes = len(message_id) + len(ref.commit) + SNAPSHOT_FIXED_BYTES
    await conn.execute(
        insert(SNAPSHOTS).values(
            message_id=message_id,
            session_id=session_id,
            position=select(MESSAGES.c.position)
            .where(MESSAGES.c.message_id == message_id)
            .scalar_subquery(),
            content_digest=ref.commit,
            base_set_id=ref.base_set_id,
            delta_set_id=ref.delta_set_id,
            raw_size=ref.raw_size,
            stored_size=ref.stored_size + row_bytes,
        )
    )


async def copy_snapshots(
    conn: Conn, *, source_session_id: int, new_session_id: int, up_to_position: int
) -> int:
    """Fork: the copied messages' snapshots, as references to the same sets (no content).

    One ``INSERT … SELECT``: each source snapshot goes to the fork's message at the same
    position (the fork's messages are already copied, in the same transaction).
    """
    copy = MESSAGES.alias("copy")
    result = await conn.execute(
        insert(SNAPSHOTS).from_select(
            [
                "message_id",
                "session_id",
                "position",
                "content_digest",
                "base_set_id",
                "delta_set_id",
                "raw_size",
                "stored_size",
            ],
            select(
                copy.c.message_id,
                literal(new_session_id, Id),
                SNAPSHOTS.c.position,
                SNAPSHOTS.c.content_digest,
                SNAPSHOTS.c.base_set_id,
                SNAPSHOTS.c.delta_set_id,
                SNAPSHOTS.c.raw_size,
                func.length(copy.c.message_id)
                + func.length(SNAPSHOTS.c.content_digest)
                + SNAPSHOT_FIXED_BYTES,
            )
            .join(
                copy,
                (copy.c.session_id == new_session_id) & (copy.c.position == SNAPSHOTS.c.position),
            )
            .where(
                SNAPSHOTS.c.session_id == source_session_id,
                SNAPSHOTS.c.position <= up_to_position,
            ),
        )
    )
    return int(result.rowcount)


# -- reading ----------------------------------------------------------------------------------


def state_statement(*, at_message: bool) -> Any:
    """The one SELECT that restores a state: every object row of the chosen snapshot.

    The snapshot is that of the newest message at or before ``:at_message_id`` (the session's
    newest when ``at_message`` is false) that has one: one backward seek on the snapshots'
    own ``(session_id, position)`` index, whatever the number of messages without state.
    Parameters: ``:session_id`` and, with ``at_message``, ``:at_message_id``.
    """
    session_id: BindParameter[int] = bindparam("session_id")
    target_msg = aliased(MESSAGES)
    chosen = select(SNAPSHOTS.c.id).where(SNAPSHOTS.c.session_id == session_id)
    if at_message:
        chosen = chosen.where(
            SNAPSHOTS.c.position
            <= select(target_msg.c.position)
            .where(
                target_msg.c.session_id == session_id,
                target_msg.c.message_id == bindparam("at_message_id"),
            )
            .scalar_subquery()
        )
    chosen_id = chosen.order_by(SNAPSHOTS.c.position.desc()).limit(1).scalar_subquery()
    base = aliased(CONTENTS)
    base_set = aliased(SETS)
    return (
        select(
            SNAPSHOTS.c.message_id,
            SNAPSHOTS.c.content_digest,
            SNAPSHOTS.c.base_set_id,
            base_set.c.digest.label("base_set_digest"),
            MEMBERS.c.set_id,
            CONTENTS.c.digest,
            CONTENTS.c.codec,
            CONTENTS.c.data,
            base.c.digest.label("base_digest"),
            base.c.codec.label("base_codec"),
            base.c.data.label("base_data"),
        )
        .select_from(SNAPSHOTS)
        .join(base_set, base_set.c.id == SNAPSHOTS.c.base_set_id)
        .join(MEMBERS, MEMBERS.c.set_id.in_([SNAPSHOTS.c.base_set_id, SNAPSHOTS.c.delta_set_id]))
        .join(CONTENTS, CONTENTS.c.id == MEMBERS.c.content_id)
        .outerjoin(base, base.c.id == CONTENTS.c.base_id)
        .where(SNAPSHOTS.c.id == chosen_id)
    )


async def messages_with_snapshots(db: Database, session_id: int) -> set[str]:
    """The ids of the session's messages that carry a sandbox snapshot (what ``/history``
    marks: a rewind or fork to one of them brings its files back)."""
    async with db.read() as conn:
        rows = await conn.execute(
            select(SNAPSHOTS.c.message_id).where(SNAPSHOTS.c.session_id == session_id)
        )
        return {str(row.message_id) for row in rows}


# Built once: restoring is on a turn's critical path, and building the statement costs more
# than SQLite takes to run it.
_STATE_LATEST: Final = Prepared(state_statement(at_message=False))
_STATE_AT: Final = Prepared(state_statement(at_message=True))


async def load_state(
    db: Database, session_id: int, *, at_message_id: str | None = None
) -> SandboxState | None:
    """The sandbox state of the newest message with a snapshot at or before ``at_message_id``
    (or the session's newest); None when there is none (or no such message in the session).
    One query."""
    if at_message_id is None:
        rows = await _STATE_LATEST.fetch(db, {"session_id": session_id})
    else:
        rows = await _STATE_AT.fetch(db, {"session_id": session_id, "at_message_id": at_message_id})
    if not rows:
        return None
    message_id, commit, base_set_id, base_set_digest = rows[0][:4]
    bases: dict[str, StoredObject] = {}
    objects: list[StoredObject] = []
    base_members: set[str] = set()
    for _m, _c, _b, _d, set_id, digest, codec, data, b_digest, b_codec, b_data in rows:
        base_obj: StoredObject | None = None
        if b_digest is not None:
            base_obj = bases.get(b_digest)
            if base_obj is None:
                base_obj = bases[b_digest] = StoredObject(b_digest, b_codec, bytes(b_data))
        objects.append(StoredObject(digest, codec, bytes(data), base_obj))
        if set_id == base_set_id:
            base_members.add(digest)
    return SandboxState(
        message_id=message_id,
        commit=commit,
        objects=tuple(objects),
        base_set=SetRef(base_set_digest, frozenset(base_members), int(base_set_id)),
    )


# -- garbage collection -----------------------------------------------------------------------


def _unreferenced_set(grace_seconds: float) -> ColumnElement[bool]:
    return and_(
        ~exists().where(SNAPSHOTS.c.base_set_id == SETS.c.id),
        ~exists().where(SNAPSHOTS.c.delta_set_id == SETS.c.id),
        SETS.c.created_at < ago(grace_seconds),
    )


def _unreferenced_content(grace_seconds: float) -> ColumnElement[bool]:
    dependant = aliased(CONTENTS)
    return and_(
        ~exists().where(MEMBERS.c.content_id == CONTENTS.c.id),
        ~exists().where(dependant.c.base_id == CONTENTS.c.id),
        CONTENTS.c.created_at < ago(grace_seconds),
    )


async def collect_garbage(
    db: Database, batch_size: int, *, grace_seconds: float = CONTENT_GRACE_SECONDS
) -> int:
    """Delete sets no snapshot names and content nothing refers to; returns content rows deleted.

    Content goes in rounds: a delta's base is referenced until the delta itself is gone.
    """
    sets = _unreferenced_set(grace_seconds)
    await delete_in_batches(
        db,
        SETS,
        select(SETS.c.id).where(sets).order_by(SETS.c.id),
        sets,
        batch_size,
        name="snapshot sets",
    )
    total = 0
    while True:
        unreferenced = _unreferenced_content(grace_seconds)
        deleted = await delete_in_batches(
            db,
            CONTENTS,
            select(CONTENTS.c.id).where(unreferenced).order_by(CONTENTS.c.id),
            unreferenced,
            batch_size,
            name="snapshot contents",
        )
        total += deleted
        if deleted == 0:
            return total


# -- accounting (benchmark, operators) --------------------------------------------------------


async def stored_bytes(conn: Conn) -> int:
    """Logical bytes in the snapshot tables, counted as ``stored_size`` counts them."""
    contents = await conn.scalar(
        select(
            func.coalesce(
                func.sum(
                    func.length(CONTENTS.c.data)
                    + func.length(CONTENTS.c.digest)
                    + func.length(CONTENTS.c.codec)
                    + CONTENT_FIXED_BYTES
                ),
                0,
            )
        )
    )
    sets = await conn.scalar(
        select(func.coalesce(func.sum(func.length(SETS.c.digest) + SET_FIXED_BYTES), 0))
    )
    members = await conn.scalar(select(func.count()).select_from(MEMBERS))
    snapshots = await conn.scalar(
        select(
            func.coalesce(
                func.sum(
                    func.length(SNAPSHOTS.c.message_id)
                    + func.length(SNAPSHOTS.c.content_digest)
                    + SNAPSHOT_FIXED_BYTES
                ),
                0,
            )
        )
    )
    return int(contents) + int(sets) + MEMBER_BYTES * int(members) + int(snapshots)


async def disk_bytes(conn: Conn) -> int | None:
    """Bytes the snapshot tables and their indexes occupy on disk (pages, headers, free space).

    None where the database cannot say (a SQLite built without ``dbstat``).
    """
    names = [t.name for t in SNAPSHOT_TABLES]
    if conn.dialect.name == "postgresql":
        total = 0
        for name in names:
            total += int(await conn.scalar(text("SELECT pg_total_relation_size(:t)"), {"t": name}))
        return total
    try:
        value = await conn.scalar(
            text(
                "SELECT SUM(pgsize) FROM dbstat WHERE name IN ("
                "SELECT name FROM sqlite_master WHERE tbl_name IN ("
                + ", ".join(f"'{n}'" for n in names)
                + "))"
            )
        )
    except SQLAlchemyError:  # the dbstat virtual table is a compile-time option
        return None
    return None if value is None else int(value)


class Snapshots:
    """The snapshot statements bound to one database: what the agent holds to restore and keep
    a session's sandbox, never the engine itself."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def load(
        self, session_id: int, *, at_message_id: str | None = None
    ) -> SandboxState | None:
        return await load_state(self._db, session_id, at_message_id=at_message_id)

    async def store(self, captured: Captured) -> SnapshotRef:
        return await store_content(self._db, captured)

    async def messages_with_snapshots(self, session_id: int) -> set[str]:
        return await messages_with_snapshots(self._db, session_id)
