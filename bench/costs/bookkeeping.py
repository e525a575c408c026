"""A message's bookkeeping statements, the way a turn runs them, timed by this process's CPU:
``Prepared`` statements run on the driver itself against the same statements sent SQLAlchemy's
ordinary way (``core.storage.prepared``; the ordinary way forced here by hand), and on
PostgreSQL the driver's way without the connections ``Database.autocommit`` holds ("unheld":
each statement of its own on a pooled connection opened for it).

One round is what the surface and the delivery records do around one turn, without the turn
itself: the delivery record, its line (``blocker``), the session and thread look-ups, the
moves to ``started`` and ``done``, the reply's ref, the shown tail, the usage ledger's row and
the stop poll. ``process_time`` counts this process only, so on PostgreSQL the server's work
is not in it (the client's is what a replica spends).

    uv run slack-agent bench bookkeeping                               # SQLite
    uv run slack-agent bench bookkeeping postgresql+asyncpg://…/fresh  # PostgreSQL
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from core.providers.base import Usage
from core.records import ANY_TAIL
from core.settings import Settings
from core.storage import Storage, engine, prepared
from core.storage.usage import LedgerEntry
from core.usage.totals import RequestUsage

ROUNDS = 200
REPEATS = 5  # alternating ways, so a drift of the machine's speed meets both alike


async def _round(storage: Storage, user: int, i: int, run: str) -> None:
    deliveries = storage.deliveries("slack")
    surface = storage.surface("slack")
    store = storage.sessions
    key = f"T1/C1/{run}.{i}"
    record = await deliveries.record(
        event_key=key,
        thread_key=key,
        author="U1",
        message_id=str(uuid.uuid4()),
        text="hello",
        context={"team": "T1"},
    )
    assert record is not None
    await deliveries.strays(key)
    assert await deliveries.blocker(record) is None
    session, _ = await store.get_or_create_session("slack", key, user_id=user)
    await surface.bind_thread(key, session.id)
    await deliveries.move(record.id, ("received",), "started", session_id=session.id)
    lease = await store.start_turn(session.id, user_message=None, last_message_id=ANY_TAIL)
    await store.stops_requested([lease])
    await deliveries.set_reply(record.id, f"{i}.5")
    await storage.usage.record(
        LedgerEntry(
            RequestUsage("openai", "bench", Usage(10, 20), None),
            "answer",
            30,
            False,
            session_id=session.id,
        )
    )
    await store.release(lease)
    await surface.add_ref(f"{key}.5", session.id, str(uuid.uuid4()), "answer")
    await surface.set_shown(session.id, None)
    assert await surface.get_thread(key) is not None
    await deliveries.move(record.id, ("started",), "done")


async def _not_held(_db: engine.Database) -> AsyncConnection | None:
    """``Database._take_held`` finding every held connection busy: a pooled one each time."""
    return None


async def main(url: str) -> dict[str, Any]:
    storage = Storage.open(Settings(database_url=url))
    direct = prepared._asyncpg, prepared._watched, prepared._engine_watched
    held = engine.Database._take_held
    try:
        await storage.migrate()
        user = await storage.sessions.get_or_create_user("bench:bookkeeping")
        run = uuid.uuid4().hex[:8]
        for i in range(20):  # warm-up: compiled statements, pooled connections
            await _round(storage, user, -i - 1, run)
        # "unheld": the driver's way, each statement of its own on a pooled connection opened
        # for it, as before ``Database.autocommit`` held connections (PostgreSQL only).
        ways = ["driver", "ordinary"]
        if storage.dialect == "postgresql":
            ways.insert(1, "unheld")
        cpu: dict[str, list[float]] = {way: [] for way in ways}
        n = 0
        for _ in range(REPEATS):
            for way in cpu:
                if way == "ordinary":
                    prepared._asyncpg = lambda conn: None
                    prepared._watched = lambda sync: True
                    prepared._engine_watched = lambda engine: True
                if way == "unheld":
                    engine.Database._take_held = _not_held  # type: ignore[method-assign,assignment]
                start = time.process_time()
                for _ in range(ROUNDS):
                    await _round(storage, user, n, run)
                    n += 1
                cpu[way].append((time.process_time() - start) * 1000 / ROUNDS)
                prepared._asyncpg, prepared._watched, prepared._engine_watched = direct
                engine.Database._take_held = held  # type: ignore[method-assign]
        return {
            "database": storage.dialect,
            "rounds": ROUNDS * REPEATS,
            **{
                f"cpu_ms_per_round_{way}": round(statistics.median(ms), 3)
                for way, ms in cpu.items()
            },
        }
    finally:
        prepared._asyncpg, prepared._watched, prepared._engine_watched = direct
        engine.Database._take_held = held  # type: ignore[method-assign]
        await storage.dispose()


def run_part(argv: list[str]) -> None:
    """``slack-agent bench bookkeeping [DATABASE_URL]`` (default: a temporary SQLite file)."""
    with tempfile.TemporaryDirectory() as tmp:
        target = argv[0] if argv else f"sqlite:///{Path(tmp) / 'b.db'}"
        print(json.dumps(asyncio.run(main(target))))
