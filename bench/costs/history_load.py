"""A whole history of 10,000 messages (no checkpoint) loaded again and again: the CPU time of
each load, ours against the Agents SDK's ``SQLiteSession`` when the ``compare`` extra is there.

``bench --compare`` times loads by the clock, every 100 messages of a growing conversation, with
the database server's time in them; this times one size by the process's CPU (``process_time``:
this process only, so on PostgreSQL the server's own work is not in it), which a shared machine
disturbs much less. Each load's texts are read, as ``bench --compare`` reads them.

    uv run --extra compare slack-agent bench history-load     # SQLite, and the peer
    uv run slack-agent bench history-load postgresql+asyncpg://…/db   # PostgreSQL (fresh)
    uv run --extra compare slack-agent bench history-load postgresql+asyncpg://…/db \
        postgresql+asyncpg://…/other   # and the SDK's SQLAlchemySession in a second fresh one

On PostgreSQL the server's work (reading the rows, writing each document as text) is not in
the process's CPU: ``server_cpu`` is that of the backends serving the database (on this
machine, read from /proc), and ``cpu_with_server`` the sum, the figure to compare with the
peer's on a shared machine (the clock, ``wall``, moves with everyone else's load). The peer
needs its own database: its default table names include ``agent_sessions``, which is ours too.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

from bench.common import ASSISTANT_TEXT, USER_TEXT
from core.messages import assistant_message, message_text, user_message
from core.settings import Settings
from core.storage import Storage

MESSAGES = 10_000
LOADS = 15
WARMUP = 3


def _text(i: int) -> str:
    return f"{USER_TEXT if i % 2 == 0 else ASSISTANT_TEXT} ({i})"


def server_cpu_ns(database: str) -> int:
    """The CPU time so far of the PostgreSQL backends serving ``database`` on this machine
    (``/proc/<pid>/schedstat``, nanoseconds), found by their process titles
    (``postgres: … <user> <database> <client> <state>``); 0 where /proc does not tell."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if title.startswith("postgres:") and f" {database} " in title:
                total += int((proc / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


async def _timed(
    load: Callable[[], Awaitable[list[str]]], server: Callable[[], int] | None = None
) -> dict[str, float]:
    for _ in range(WARMUP):
        await load()
    cpu: list[float] = []
    wall: list[float] = []
    served: list[float] = []
    for _ in range(LOADS):
        s0 = server() if server else 0
        c0, w0 = time.process_time(), time.perf_counter()
        texts = await load()
        cpu.append((time.process_time() - c0) * 1000)
        wall.append((time.perf_counter() - w0) * 1000)
        if server:
            served.append((server() - s0) / 1e6)
        if len(texts) != MESSAGES:
            raise AssertionError(f"loaded {len(texts)} messages, not {MESSAGES}")
    p95 = round(0.95 * (LOADS - 1))
    figures = {"cpu": cpu, "wall": wall}
    if served:
        figures["server_cpu"] = served
        figures["cpu_with_server"] = [a + b for a, b in zip(cpu, served, strict=True)]
    result: dict[str, float] = {}
    for name, values in figures.items():
        values.sort()
        result[f"{name}_p50_ms"] = round(statistics.median(values), 1)
        result[f"{name}_p95_ms"] = round(values[p95], 1)
    return result


def _server(url: str) -> Callable[[], int]:
    database = make_url(url).database or ""
    return lambda: server_cpu_ns(database)


async def ours(url: str) -> dict[str, float]:
    storage = Storage.open(Settings(database_url=url))
    try:
        await storage.migrate()
        store = storage.sessions
        session, _ = await store.get_or_create_session(
            "bench-history", str(uuid.uuid4()), user_id=None
        )
        rows = [
            ((user_message if i % 2 == 0 else assistant_message)(_text(i)), False)
            for i in range(MESSAGES)
        ]
        await store.import_messages(session.id, rows)

        async def load() -> list[str]:
            return [message_text(m.message) for m in await store.history(session.id)]

        return await _timed(load, _server(url) if url.startswith("postgresql") else None)
    finally:
        await storage.dispose()


async def _filled_peer(session: Any) -> Callable[[], Awaitable[list[str]]]:
    """An Agents SDK session given the benchmark's messages; returns its timed load."""
    for start in range(0, MESSAGES, 500):
        await session.add_items(
            [
                {"role": "user" if i % 2 == 0 else "assistant", "content": _text(i)}
                for i in range(start, start + 500)
            ]
        )

    async def load() -> list[str]:
        return [str(row["content"]) for row in await session.get_items()]

    return load


async def agents_sqlite(path: str) -> dict[str, float]:
    from agents import SQLiteSession

    session: Any = SQLiteSession("bench", db_path=path)  # its item types are not ours
    try:
        load = await _filled_peer(session)
        return await _timed(load)
    finally:
        session.close()


async def agents_sqlalchemy(url: str) -> dict[str, float]:
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession

    session: Any = SQLAlchemySession.from_url("bench", url=url, create_tables=True)
    try:
        load = await _filled_peer(session)
        return await _timed(load, _server(url))
    finally:
        await session.engine.dispose()


async def main(url: str | None, peer_url: str | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"messages": MESSAGES, "loads": LOADS}
    with tempfile.TemporaryDirectory() as tmp:
        if url:
            result["slack-agent [postgresql]"] = await ours(url)
            if peer_url:
                result["agents SQLAlchemySession [postgresql]"] = await agents_sqlalchemy(peer_url)
            return result
        result["slack-agent [sqlite]"] = await ours(f"sqlite+aiosqlite:///{Path(tmp) / 'o.db'}")
        try:
            result["agents SQLiteSession"] = await agents_sqlite(str(Path(tmp) / "peer.db"))
        except ModuleNotFoundError:
            result["agents SQLiteSession"] = "not installed: uv sync --extra compare"
    return result


def run_part(argv: list[str]) -> None:
    """``slack-agent bench history-load [DATABASE_URL [PEER_URL]]``."""
    print(json.dumps(asyncio.run(main(*argv[:2]))))
