"""SQLite's in-process write lock: one writer at a time, urgent writers (the delivery records an
acknowledgement waits for) ahead of ordinary ones, and a cancelled waiter never keeps it."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import String, bindparam, column, insert, table, text

from core.errors import DatabaseError
from core.storage.engine import (
    SQLITE_READ_BUSY_MS,
    Conn,
    Database,
    _WriteLock,
    create_database,
)
from core.storage.prepared import Prepared


async def test_urgent_writers_go_before_waiting_ordinary_ones_each_queue_in_order() -> None:
    lock = _WriteLock()
    order: list[str] = []

    async def write(name: str, urgent: bool) -> None:
        async with lock.hold(urgent=urgent):
            order.append(name)
            await asyncio.sleep(0)

    async with lock.hold():  # a turn's write holds it while the others arrive
        tasks = [
            asyncio.create_task(write(name, urgent))
            for name, urgent in [("turn 1", False), ("ack 1", True), ("turn 2", False)]
        ]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(write("ack 2", True)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["ack 1", "ack 2", "turn 1", "turn 2"]


async def test_a_waiter_cancelled_before_or_after_being_handed_the_lock_passes_it_on() -> None:
    lock = _WriteLock()
    entered: list[str] = []

    async def write(name: str) -> None:
        async with lock.hold():
            entered.append(name)

    async with lock.hold():
        early = asyncio.create_task(write("cancelled while waiting"))
        handed = asyncio.create_task(write("cancelled once handed"))
        last = asyncio.create_task(write("last"))
        await asyncio.sleep(0)
        early.cancel()
        await asyncio.sleep(0)
    handed.cancel()  # the release handed it the lock; it is cancelled before it runs
    await asyncio.gather(early, handed, last, return_exceptions=True)
    assert entered == ["last"]
    async with asyncio.timeout(1):
        async with lock.hold():  # free again
            pass


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite: the lock above
async def test_postgresql__an_urgent_write_goes_through_while_turns_hold_every_pooled_connection(
    database_url: str, backend: str
) -> None:
    db = create_database(database_url, pool_size=1)  # one connection, one overflow
    holding = asyncio.Event()
    done = asyncio.Event()
    held = 0

    async def turn_write() -> None:
        nonlocal held
        async with db.write() as conn:
            await conn.execute(text("SELECT 1"))
            held += 1
            if held == 2:
                holding.set()
            await done.wait()

    try:
        turns = [asyncio.create_task(turn_write()) for _ in range(2)]
        await asyncio.wait_for(holding.wait(), 10)
        async with asyncio.timeout(10), db.write(urgent=True) as conn:
            assert await conn.scalar(text("SELECT 2")) == 2
        done.set()
        await asyncio.gather(*turns)
    finally:
        done.set()
        await db.dispose()


# A mark sent as a prepared statement: SQLAlchemy never hears of the write's transaction.
_MARK = Prepared(
    insert(table("marks", column("name"))).values(name=bindparam("name", type_=String()))
)


@pytest.mark.parametrize("backend", ["sqlite"])  # SQLite's inline writes share one connection
@pytest.mark.parametrize("way", ["ordinary", "prepared"])
async def test_sqlite__a_write_that_fails_or_is_cancelled_leaves_nothing_for_the_next(
    db: Database, backend: str, way: str
) -> None:
    """Inline writes reuse one connection (``Database._sqlite_writer_begin``): whatever a write
    left undone, by an error or a cancellation between statements, must be rolled back before
    the next one begins, and the connection's busy timeout of 0 must never reach the pool's
    readers. Its statements sent SQLAlchemy's ordinary way begin SQLAlchemy's view of the
    transaction; prepared ones do not, and SQLite's transaction must be undone all the same,
    keeping the connection."""

    async def mark(conn: Conn, name: str) -> None:
        if way == "prepared":
            await _MARK.run(conn, {"name": name})
        else:
            await conn.execute(text(f"INSERT INTO marks VALUES ('{name}')"))

    async with db.write() as conn:
        await conn.execute(text("CREATE TABLE marks (name TEXT)"))
    writer = db._writer

    with pytest.raises(DatabaseError, match="boom"):  # noqa: PT012 (a write that fails inside)
        async with db.write() as conn:
            await mark(conn, "failed")
            raise DatabaseError("boom")

    inside = asyncio.Event()

    async def cancelled() -> None:
        async with db.write() as conn:
            await mark(conn, "cancelled")
            inside.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(cancelled())
    await asyncio.wait_for(inside.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async with db.write() as conn:
        await mark(conn, "kept")
    async with db.read() as conn:
        assert list((await conn.execute(text("SELECT name FROM marks"))).scalars()) == ["kept"]
        assert await conn.scalar(text("PRAGMA busy_timeout")) == SQLITE_READ_BUSY_MS
    assert db._writer is writer  # rolled back, not replaced
