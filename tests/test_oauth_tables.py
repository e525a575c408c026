"""slack_sdk's OAuth tables are created under the migration lock, so replicas starting together
never race on ``CREATE TABLE`` (one of them used to exit). Real processes, both databases."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import AsyncConnection

from core.storage.engine import create_database
from core.storage.migrate import _ADVISORY_LOCK_KEY
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

SLACK_TABLES = {"slack_bots", "slack_installations", "slack_oauth_states"}
REPLICAS = 4

# What ``serve`` does for multi-workspace installs, alone: open the install stores.
OPEN_STORES = """
import asyncio, sys
from core.settings import load_settings
from core.storage import Storage
from bot.installations import open_install_stores

async def main() -> None:
    storage = Storage.open(load_settings(database_url=sys.argv[1]))
    try:
        stores = await open_install_stores(storage, "111.222")
        await stores.dispose()
    finally:
        await storage.dispose()

asyncio.run(main())
"""


def start(url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", OPEN_STORES, url],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def tables(url: str) -> set[str]:
    db = create_database(url)
    try:
        async with db.read() as conn:
            names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await db.dispose()
    return names & SLACK_TABLES


async def finished(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    outcomes = []
    for proc in procs:
        _, err = await asyncio.to_thread(proc.communicate, timeout=400)
        outcomes.append((proc.returncode, err))
    return outcomes


async def test_oauth_tables__replicas_starting_together_all_start(empty_database_url: str) -> None:
    procs = [start(empty_database_url) for _ in range(REPLICAS)]
    outcomes = await finished(procs)
    assert [code for code, _ in outcomes] == [0] * REPLICAS, outcomes
    assert await tables(empty_database_url) == SLACK_TABLES


@pytest.mark.parametrize("backend", ["postgresql"])  # the lock replicas migrate under
async def test_oauth_tables__are_created_under_the_migration_lock(
    empty_database_url: str, backend: str
) -> None:
    db = create_database(empty_database_url)
    try:
        async with db.read() as held:
            assert isinstance(held, AsyncConnection)
            await held.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _ADVISORY_LOCK_KEY})
            await held.commit()
            procs = [start(empty_database_url) for _ in range(REPLICAS)]
            # Every replica waits for the lock, and none created a table meanwhile.
            deadline = time.monotonic() + 400
            while await waiting(held) < REPLICAS:
                running = [p.poll() is None for p in procs]
                assert all(running), await finished(procs)
                assert time.monotonic() < deadline, "the replicas never waited for the lock"
                await asyncio.sleep(0.1)
            assert await tables(empty_database_url) == set()
            await held.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _ADVISORY_LOCK_KEY})
            await held.commit()
    finally:
        await db.dispose()
    outcomes = await finished(procs)
    assert [code for code, _ in outcomes] == [0] * REPLICAS, outcomes
    assert await tables(empty_database_url) == SLACK_TABLES


async def waiting(conn: AsyncConnection) -> int:
    """Sessions waiting for the migration's advisory lock."""
    found = await conn.execute(
        text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    )
    await conn.commit()
    return int(found.scalar_one())
