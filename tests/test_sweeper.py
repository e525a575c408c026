"""The sweeper on both databases: each pass, re-checks, the cap, and parallel runs."""

from __future__ import annotations

import asyncio
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, insert, select, update

from core.messages import user_message
from core.storage import batched
from core.storage.deliveries import (
    DELIVERIES,
    FINISHED_TTL_SECONDS,
    OFFER_TTL_SECONDS,
    STRAY_SECONDS,
    D,
    Deliveries,
    sweep_finished_deliveries,
)
from core.storage.dialect import ago
from core.storage.engine import Database
from core.storage.models import (
    AgentSession,
    AgentSessionSnapshot,
    SnapshotContent,
    SnapshotSet,
    SnapshotSetMember,
    UsageTotal,
)
from core.storage.retention import RetentionPolicy, load_policy, set_policy
from core.storage.sessions import SessionStore
from core.storage.sweeper import sweep
from core.storage.usage import sweep_totals
from tests.helpers import (
    add_exchange,
    backdate,
    new_session,
    read_json_line,
    start_worker,
    stop_workers,
)

SESSIONS = AgentSession.__table__
OFF = RetentionPolicy(max_idle_days=0, max_per_user=0)


async def remaining(db: Database) -> set[int]:
    async with db.read() as conn:
        return set((await conn.execute(select(SESSIONS.c.id))).scalars())


async def sessions(store: SessionStore, n: int, owner: str = "slack:T1:U1", **kw: Any) -> list[int]:
    user_id = await store.get_or_create_user(owner)
    created = []
    for i in range(n):
        info, _ = await store.get_or_create_session("slack", f"{owner}/{i}", user_id=user_id, **kw)
        created.append(info.id)
    return created


async def test_expired_pass__deletes_only_expired_temporary_sessions(
    store: SessionStore, db: Database
) -> None:
    expired = await sessions(store, 3, temporary=True)
    fresh = await sessions(store, 2, owner="slack:T1:U2", temporary=True)
    persisted = await sessions(store, 2, owner="slack:T1:U3")
    await backdate(db, expired, expires_at=10)
    report = await sweep(db, OFF, staleness_seconds=60, batch_size=2)
    assert report.expired == 3
    assert report.sessions == 3
    assert await remaining(db) == set(fresh + persisted)


async def test_idle_pass__deletes_persisted_sessions_idle_past_the_limit(
    store: SessionStore, db: Database
) -> None:
    old = await sessions(store, 3)
    recent = await sessions(store, 2, owner="slack:T1:U2")
    temporary = await sessions(store, 1, owner="slack:T1:U3", temporary=True)
    await backdate(db, old + temporary, updated_at=31 * 86400)
    report = await sweep(db, RetentionPolicy(30, 0), staleness_seconds=60, batch_size=100)
    assert report.idle == 3
    assert await remaining(db) == set(recent + temporary)


async def test_cap_pass__keeps_most_recent_and_breaks_ties_by_id(
    store: SessionStore, db: Database
) -> None:
    mine = await sessions(store, 6)
    theirs = await sessions(store, 2, owner="slack:T1:U2")
    await backdate(db, mine[:4], updated_at=100)  # four tied, older than the last two
    report = await sweep(db, RetentionPolicy(0, 3), staleness_seconds=60, batch_size=2)
    assert report.over_cap == 3
    # Kept: the two most recent, then the tie among the four broken by the highest id.
    assert await remaining(db) == {mine[5], mine[4], mine[3], *theirs}


async def test_pass__is_linear_each_batch_starts_after_the_last_and_the_cap_ranks_once(
    store: SessionStore, db: Database
) -> None:
    expired = await sessions(store, 7, owner="slack:T1:U9", temporary=True)
    await backdate(db, expired, expires_at=10)
    mine = await sessions(store, 9)
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.upper().split()))

    event.listen(db.sync_engine, "before_cursor_execute", record)
    try:
        report = await sweep(db, RetentionPolicy(0, 2), staleness_seconds=60, batch_size=2)
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", record)
    assert (report.expired, report.over_cap) == (7, 7)
    assert await remaining(db) == set(mine[-2:])
    # The per-user ranking (a scan of every persisted session) runs once, not once per batch.
    assert len([s for s in seen if "ROW_NUMBER" in s]) == 1
    # Four batches of expired candidates: every one after the first starts past the last id.
    expired_selects = [
        s for s in seen if s.startswith("SELECT AGENT_SESSIONS.ID") and "EXPIRES_AT <" in s
    ]
    assert len(expired_selects) == 4
    assert all("AGENT_SESSIONS.ID >" in s for s in expired_selects[1:])


async def test_batches__on_sqlite_yield_the_write_lock_as_long_as_they_held_it(
    store: SessionStore, db: Database, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SQLite has one writer; a sweeper in its own thread going straight from one batch to the
    # next kept the replica's acknowledgements (each a write) waiting. After each batch it
    # must leave the lock free for as long as it held it. PostgreSQL locks rows: no pause.
    expired = await sessions(store, 5, temporary=True)
    await backdate(db, expired, expires_at=10)
    pauses: list[float] = []
    original = asyncio.sleep

    async def recording(delay: float, *args: Any) -> Any:
        if sys._getframe(1).f_code.co_filename == batched.__file__:
            pauses.append(delay)
        return await original(delay, *args)

    monkeypatch.setattr(batched.asyncio, "sleep", recording)
    report = await sweep(db, OFF, staleness_seconds=60, batch_size=2)
    assert report.expired == 5
    if backend == "sqlite":
        assert len(pauses) == 3  # batches of 2, 2 and 1
        assert all(p > 0 for p in pauses)
    else:
        assert pauses == []


async def test_active_session__is_never_deleted_by_any_pass(
    store: SessionStore, db: Database
) -> None:
    expired = await sessions(store, 1, owner="slack:T1:U1", temporary=True)
    idle = await sessions(store, 1, owner="slack:T1:U2")
    capped = await sessions(store, 3, owner="slack:T1:U3")
    leases = [
        await store.start_turn(sid, user_message=user_message("busy"), last_message_id=None)
        for sid in (expired[0], idle[0], capped[0])
    ]
    await backdate(db, expired, expires_at=3600)
    await backdate(db, idle + capped[:1], updated_at=90 * 86400)
    report = await sweep(db, RetentionPolicy(30, 1), staleness_seconds=60)
    assert report.sessions == 1  # only capped[1], the older of the two inactive ones
    assert await remaining(db) == {expired[0], idle[0], capped[0], capped[2]}
    for lease in leases:
        await store.release(lease)  # a release is a write: it touches updated_at
    await backdate(db, idle, updated_at=90 * 86400)
    report = await sweep(db, RetentionPolicy(30, 1), staleness_seconds=60)
    assert (report.expired, report.idle, report.over_cap) == (1, 1, 1)
    assert await remaining(db) == {capped[0]}


async def test_batches__recheck_each_row_before_deleting(store: SessionStore, db: Database) -> None:
    idle = await sessions(store, 4)
    await backdate(db, idle, updated_at=40 * 86400)
    touched: list[int] = []

    async def between_select_and_delete(name: str, ids: list[Any]) -> None:
        if not touched:  # a user comes back to one candidate of the first batch
            touched.append(ids[0])
            lease = await store.start_turn(
                ids[0], user_message=user_message("back"), last_message_id=None
            )
            await store.release(lease)

    report = await sweep(
        db,
        RetentionPolicy(30, 0),
        staleness_seconds=60,
        batch_size=2,
        on_batch=between_select_and_delete,
    )
    assert report.idle == 3
    assert await remaining(db) == set(touched)


@pytest.mark.slow  # real processes
async def test_parallel_sweepers__neither_fails_nor_double_deletes(
    store: SessionStore, db: Database, database_url: str
) -> None:
    expired = await sessions(store, 24, temporary=True)
    idle = await sessions(store, 12, owner="slack:T1:U2")
    await backdate(db, expired, expires_at=60)
    await backdate(db, idle, updated_at=40 * 86400)
    procs = [start_worker("sweep", database_url, 60, 4, 30, 0) for _ in range(2)]
    try:
        for proc in procs:
            assert await asyncio.to_thread(read_json_line, proc) == {"ready": True}
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = [(await asyncio.to_thread(read_json_line, p))["report"] for p in procs]
        await asyncio.to_thread(stop_workers, procs, wait=60)
    finally:
        stop_workers(procs)
    assert sum(r["expired"] for r in reports) == 24
    assert sum(r["idle"] for r in reports) == 12
    assert await remaining(db) == set()
    assert all(p.returncode == 0 for p in procs)


async def test_snapshot_contents__unreferenced_old_content_is_collected(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    contents = SnapshotContent.__table__
    sets = SnapshotSet.__table__
    async with db.write() as conn:
        await conn.execute(
            contents.insert(),
            [
                {"digest": d * 64, "codec": "zstd", "raw_size": 1, "stored_size": 1, "data": b"x"}
                for d in "abc"
            ],
        )
        by_digest = dict((await conn.execute(select(contents.c.digest, contents.c.id))).all())
        set_id = (
            await conn.execute(sets.insert().values(digest="d" * 64, size=1))
        ).inserted_primary_key[0]
        await conn.execute(
            SnapshotSetMember.__table__.insert().values(
                set_id=set_id, content_id=by_digest["a" * 64]
            )
        )
        await conn.execute(
            AgentSessionSnapshot.__table__.insert().values(
                message_id=ids[1],
                session_id=session.id,
                position=1,
                content_digest="a" * 64,
                base_set_id=set_id,
                raw_size=1,
                stored_size=1,
            )
        )
        await conn.execute(
            update(contents).where(contents.c.digest != "c" * 64).values(created_at=ago(7200))
        )
        await conn.execute(update(sets).values(created_at=ago(7200)))
    report = await sweep(db, OFF, staleness_seconds=60)
    assert report.snapshot_contents == 1  # b: unreferenced and old; c is too young to collect
    async with db.read() as conn:
        left = set((await conn.execute(select(contents.c.digest))).scalars())
    assert left == {"a" * 64, "c" * 64}


async def test_extra_passes__run_and_are_reported(store: SessionStore, db: Database) -> None:
    seen: list[int] = []

    async def bot_tables(database: Database, batch_size: int) -> int:
        seen.append(batch_size)
        return 7

    report = await sweep(
        db, OFF, staleness_seconds=60, batch_size=9, extra_passes=[("events", bot_tables)]
    )
    assert report.extra == {"events": 7}
    assert seen == [9]


async def test_retention__runtime_values_override_environment(db: Database) -> None:
    defaults = RetentionPolicy(30, 30)
    assert await load_policy(db, defaults) == defaults
    await set_policy(db, defaults, max_per_user=5)
    assert await load_policy(db, defaults) == RetentionPolicy(30, 5)
    await set_policy(db, defaults, max_idle_days=0)
    assert await load_policy(db, defaults) == RetentionPolicy(0, 5)
    with pytest.raises(ValueError, match="max per user"):
        await set_policy(db, defaults, max_per_user=-1)
    assert await load_policy(db, defaults) == RetentionPolicy(0, 5)


async def test_deliveries_pass__finished_after_a_day_strays_after_ten_minutes_active_never(
    db: Database,
) -> None:
    deliveries = Deliveries(db, "slack")

    async def add(key: str, **values: Any) -> None:
        stray = values.pop("stray", False)
        record = await deliveries.record(
            event_key=f"T1/C1/{key}",
            thread_key="T1/C1/1.0",
            author="U1",
            message_id=str(uuid.uuid4()),
            text=key,
            context={},
            stray=stray,
        )
        assert record is not None
        if not values:
            return
        async with db.write() as conn:
            await conn.execute(update(DELIVERIES).where(D.id == record.id).values(**values))

    await add("2.0", state="done")
    await add("3.0", state="done", updated_at=ago(FINISHED_TTL_SECONDS + 60))
    await add("4.0", stray=True)
    await add("5.0", stray=True, created_at=ago(STRAY_SECONDS + 60))
    await add("6.0", state="received", updated_at=ago(10 * FINISHED_TTL_SECONDS))
    assert await sweep_finished_deliveries(db, batch_size=1) == 2
    async with db.read() as conn:
        left = set((await conn.execute(select(D.event_key))).scalars())
    assert left == {"T1/C1/2.0", "T1/C1/4.0", "T1/C1/6.0"}
    # A stray past its window is not adopted either (it may be read before the sweep).
    await add("7.0", stray=True, created_at=ago(STRAY_SECONDS + 60))
    strays = await deliveries.strays("T1/C1/1.0")
    assert [(r.event_key, r.text) for r in strays] == [("T1/C1/4.0", "")]  # no text kept
    words = {"T1/C1/4.0": ("read back", {"files": []})}
    adopted = await deliveries.adopt_strays("T1/C1/1.0", words, ["T1/C1/4.0"])
    assert [(r.event_key, r.text, r.context) for r in adopted] == [
        ("T1/C1/4.0", "read back", {"files": []})
    ]
    assert adopted[0].state == "received"
    assert adopted[0].owner == deliveries.owner
    assert await deliveries.adopt_strays("T1/C1/1.0", words, ["T1/C1/4.0"]) == []  # once


async def test_strays__kept_without_text_and_dropped_when_their_message_is_gone(
    db: Database,
) -> None:
    """A stray keeps where and by whom, never the words (they stay in Slack until it is
    adopted); one whose message the surface no longer has is deleted, not answered, and one
    written while another was being adopted is left for its own adoption."""
    deliveries = Deliveries(db, "slack")

    async def add(key: str, *, stray: bool) -> None:
        await deliveries.record(
            event_key=f"T1/C1/{key}",
            thread_key="T1/C1/1.0",
            author="U1",
            message_id=str(uuid.uuid4()),
            text=f"words of {key}",
            context={"ts": key},
            stray=stray,
        )

    await add("1.0", stray=False)
    await add("2.0", stray=True)
    await add("3.0", stray=True)
    async with db.read() as conn:
        rows = {r.event_key: r.text for r in await conn.execute(select(D.event_key, D.text))}
    assert rows == {"T1/C1/1.0": "words of 1.0", "T1/C1/2.0": "", "T1/C1/3.0": ""}
    asked = [r.event_key for r in await deliveries.strays("T1/C1/1.0")]
    await add("4.0", stray=True)  # arrives while the surface is read
    adopted = await deliveries.adopt_strays("T1/C1/1.0", {"T1/C1/3.0": ("x", {})}, asked)
    assert [r.event_key for r in adopted] == ["T1/C1/3.0"]
    async with db.read() as conn:
        left = dict((await conn.execute(select(D.event_key, D.state))).all())
    assert left == {"T1/C1/1.0": "received", "T1/C1/3.0": "received", "T1/C1/4.0": "stray"}


async def test_deliveries_pass__offers_nobody_answered_go_after_their_lifetime(
    db: Database,
) -> None:
    """An ignored Send/Discard (``offered``) or Send anyway (``stale``) is nobody's record: it
    is swept with the person's words once its lifetime is over, and the oldest-record gauge
    stops growing with it."""
    deliveries = Deliveries(db, "slack")
    ages = {"1.0": 60.0, "2.0": OFFER_TTL_SECONDS + 60, "3.0": 60.0, "4.0": OFFER_TTL_SECONDS + 60}
    for key, state in (("1.0", "offered"), ("2.0", "offered"), ("3.0", "stale"), ("4.0", "stale")):
        record = await deliveries.record(
            event_key=f"T1/C1/{key}",
            thread_key=f"T1/C1/{key}",
            author="U1",
            message_id=str(uuid.uuid4()),
            text=f"words {key}",
            context={},
        )
        assert record is not None
        async with db.write() as conn:
            await conn.execute(
                update(DELIVERIES)
                .where(D.id == record.id)
                .values(state=state, owner=None, lease_at=None, updated_at=ago(ages[key]))
            )
    assert await sweep_finished_deliveries(db, batch_size=1) == 2
    async with db.read() as conn:
        left = set((await conn.execute(select(D.event_key, D.state))).all())
    assert left == {("T1/C1/1.0", "offered"), ("T1/C1/3.0", "stale")}
    assert {c.state for c in await deliveries.counts()} == {"offered", "stale"}
    assert max(c.oldest_age_seconds for c in await deliveries.counts()) < OFFER_TTL_SECONDS


async def test_usage_totals_pass__drops_windows_long_over_and_keeps_the_current(
    db: Database,
) -> None:
    """The running totals a claim reads are the current window's; the sweeper drops those of
    windows that began over ``TOTALS_KEPT_SECONDS`` ago (the ledger keeps every request)."""
    now = datetime.now(UTC).replace(microsecond=0)
    rows = [
        ("all", "month", now - timedelta(days=100)),
        ("user:slack:T1:U1", "day", now - timedelta(days=71)),
        ("all", "month", now - timedelta(days=20)),
        ("user:slack:T1:U1", "day", now),
    ]
    async with db.write() as conn:
        for account, period, start in rows:
            await conn.execute(
                insert(UsageTotal).values(
                    account=account,
                    period=period,
                    window_start=start,
                    tokens=1,
                    nanousd=0,
                    output_tokens=1,
                    requests=1,
                    priced_requests=0,
                )
            )
    assert await sweep_totals(db, 100) == 2
    async with db.read() as conn:
        kept = (await conn.execute(select(UsageTotal.window_start))).scalars().all()
    assert sorted(kept) == [now - timedelta(days=20), now]
    assert await sweep_totals(db, 100) == 0
