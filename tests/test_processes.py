"""Concurrency proven with real processes: each child has its own engine, pool and event loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest
from sqlalchemy import text

from core.messages import user_message
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from tests.helpers import (
    add_exchange,
    age_lock,
    new_session,
    read_json_line,
    start_worker,
    stop_workers,
)

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

CLAIMERS = 5


def release_together(procs: list[subprocess.Popen[str]]) -> None:
    """Wait until every child is connected and ready, then let them all go at once."""
    for proc in procs:
        assert read_json_line(proc) == {"ready": True}
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


async def test_claim__concurrent_processes_exactly_one_wins(
    store: SessionStore, database_url: str
) -> None:
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    procs = [start_worker("claim", database_url, session.id, ids[-1]) for _ in range(CLAIMERS)]
    try:
        await asyncio.to_thread(release_together, procs)
        results = [await asyncio.to_thread(read_json_line, p) for p in procs]
    finally:
        stop_workers(procs)
    outcomes = sorted(r["result"] for r in results)
    assert outcomes == ["agent_session_busy"] * (CLAIMERS - 1) + ["won"], outcomes
    winner = next(r for r in results if r["result"] == "won")
    persisted = await store.messages(session.id)
    assert [m.message_id for m in persisted] == [*ids, winner["message_id"]]
    assert [m.position for m in persisted] == [0, 1, 2]


async def test_claim__processes_on_an_empty_session_with_null_tail(
    store: SessionStore, database_url: str
) -> None:
    _, session = await new_session(store)
    procs = [start_worker("claim", database_url, session.id, "-") for _ in range(CLAIMERS)]
    try:
        await asyncio.to_thread(release_together, procs)
        results = [await asyncio.to_thread(read_json_line, p) for p in procs]
    finally:
        stop_workers(procs)
    assert sorted(r["result"] for r in results).count("won") == 1
    assert {r["result"] for r in results} <= {"won", "agent_session_busy"}
    assert len(await store.messages(session.id)) == 1


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


async def waiting_on_a_lock(db: Database) -> None:
    """Until another connection to this database waits on a lock (PostgreSQL): a statement
    has started and waits for a transaction that has not committed. Observed, not slept on."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    async with asyncio.timeout(60):
        while True:
            async with db.read() as conn:
                if await conn.scalar(query):
                    return
            await asyncio.sleep(0.01)


async def test_stale__a_claim_waiting_on_a_release_that_appends_is_refused(
    store: SessionStore, db: Database, database_url: str, backend: str
) -> None:
    """A turn whose lock went stale (a slow or cut-off replica) ends: its answer and release
    commit while the claim of a client who saw only the question, which found the lock stale,
    waits on the session (on PostgreSQL its statement started before the commit and waits on
    the row's lock). The claim is refused as stale, naming the answer, and writes nothing: the
    stale guard is re-checked on the row the release committed, not on the claim's older
    snapshot (migration 0011). A guard on the messages, folded into the claim's statement,
    fails here."""
    _, session = await new_session(store)
    lease = await store.start_turn(
        session.id, user_message=user_message("the question"), last_message_id=None
    )
    await age_lock(db, session.id, 120)  # past the claimer's window (60 s)
    assert lease.tail is not None
    question = lease.tail.message_id
    releaser = start_worker(
        "finish_held", database_url, session.id, lease.token, lease.next_position
    )
    claimer = start_worker("claim", database_url, session.id, question)
    try:
        # The answer is written, its transaction open; the claimer is connected.
        assert await asyncio.to_thread(read_json_line, releaser) == {"ready": True}
        assert await asyncio.to_thread(read_json_line, claimer) == {"ready": True}
        go(claimer)
        if backend == "postgresql":
            await waiting_on_a_lock(db)
        go(releaser)
        answer = (await asyncio.to_thread(read_json_line, releaser))["committed"]
        result = await asyncio.to_thread(read_json_line, claimer)
    finally:
        stop_workers([releaser, claimer], wait=10)
    assert result == {"result": "agent_session_stale", "actual": answer}
    assert [m.message_id for m in await store.messages(session.id)] == [question, answer]
    assert not await store.is_turn_active(session.id)


async def test_crash__sigkill_mid_turn_keeps_user_message_and_lock_frees_after_window(
    database_url: str, db: Database
) -> None:
    store = SessionStore(db, staleness_seconds=1.0)
    _, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    proc = start_worker("hang", database_url, session.id, ids[-1])
    try:
        claimed = await asyncio.to_thread(read_json_line, proc)
        assert await store.is_turn_active(session.id)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        stop_workers([proc])
    assert proc.returncode == -signal.SIGKILL
    persisted = await store.messages(session.id)
    assert persisted[-1].message_id == claimed["claimed"]
    assert persisted[-1].message["parts"][0]["text"] == "this turn will be killed"
    # No sweeper, no cleanup: the lock frees itself once the heartbeat is older than the window.
    for _ in range(300):
        if not await store.is_turn_active(session.id):
            break
        await asyncio.sleep(0.02)
    assert not await store.is_turn_active(session.id)
    lease = await store.start_turn(
        session.id,
        user_message={"id": "6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b", "role": "user", "parts": []},
        last_message_id=claimed["claimed"],
    )
    await store.release(lease)
