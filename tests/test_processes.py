"""Concurrency proven with real processes: each child has its own engine, pool and event loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from core.storage.engine import Database
from core.storage.sessions import SessionStore
from tests.helpers import add_exchange, new_session, read_json_line, start_worker, stop_workers

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
