"""A bench run's SQLite write transactions again, on a bare ``sqlite3`` connection:
``slack-agent bench write-replay TRACE [ROUNDS]``.

``TRACE`` is what ``BENCH_SQL_TRACE=TRACE … bench turns "" N --counts`` wrote
(``bench.load.counts``). Every transaction of the run (the turns' and the intake's, in the
order they committed) is run as it was on a copy of a freshly migrated file: ``BEGIN
IMMEDIATE``, its statements with their values (a ``Prepared`` statement's SQL with its
parameters, so SQLite's statement cache serves it as it serves the product), then ``COMMIT``,
with the product's settings (WAL, ``synchronous=NORMAL``, foreign keys on) and none of the
product's Python.

Reported: this thread's CPU per transaction, split into the ``BEGIN``, the statements and the
commit, by kind of transaction (the statements' first words); and the pages each commit wrote
to the WAL (its growth, with automatic checkpoints off, in frames of a page and its header).
What the product spends on a write transaction beyond these figures is its own Python, and
how much colder the CPU's caches are on a busy event loop than in this loop.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

Transaction = tuple[str, list[tuple[str, tuple[Any, ...]]], str]  # thread, statements, end


def transactions(trace: Path) -> list[Transaction]:
    """The trace's transactions, in commit order. A line of SQLite's trace callback right after
    a ``Prepared`` line is that statement; one equal to the line before it is a trigger's
    (run by SQLite again, not by the replay); any other is a statement sent SQLAlchemy's
    ordinary way, replayed with its values as written in."""
    done: list[Transaction] = []
    open_: dict[str, list[tuple[str, tuple[Any, ...]]]] = {}
    prepared: dict[str, bool] = {}
    last: dict[str, str] = {}
    for line in trace.read_text().splitlines():
        tag, body = line.split("\t", 1)
        if tag.startswith("P"):
            sql, values = ast.literal_eval(body)
            open_.setdefault(tag[1:], []).append((sql, tuple(values)))
            prepared[tag[1:]] = True
            continue
        sql = ast.literal_eval(body)
        if sql == "BEGIN IMMEDIATE":
            open_[tag] = []
        elif sql in ("COMMIT", "ROLLBACK"):
            done.append((tag, open_.pop(tag, []), sql))
        elif prepared.get(tag):
            prepared[tag] = False
        elif last.get(tag) != sql:
            open_.setdefault(tag, []).append((sql, ()))
        last[tag] = sql
    return done


def _kind(statements: list[tuple[str, tuple[Any, ...]]]) -> str:
    return " + ".join(" ".join(sql.split()[:3]) for sql, _ in statements) or "(empty)"


def _connect(path: Path, *, checkpoints: bool) -> sqlite3.Connection:
    """A bare connection with the product's settings (``core.storage.engine.sqlite_settings``)."""
    from core.storage.engine import sqlite_settings

    conn = sqlite3.connect(path, cached_statements=256)
    sqlite_settings(conn)
    if not checkpoints:
        conn.execute("PRAGMA wal_autocheckpoint=0")
    return conn


def replay(
    txs: list[Transaction], schema: Path, into: Path, *, checkpoints: bool = True
) -> dict[str, list[tuple[int, int, int, int]]]:
    """Each transaction's CPU (begin, statements, commit, in ns) and the WAL's growth in
    bytes, by kind, on a fresh copy of ``schema``."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{into}{suffix}").unlink(missing_ok=True)
    shutil.copy(schema, into)
    conn = _connect(into, checkpoints=checkpoints)
    wal = Path(f"{into}-wal")
    size = wal.stat().st_size if wal.exists() else 0
    by_kind: dict[str, list[tuple[int, int, int, int]]] = collections.defaultdict(list)
    for _, statements, end in txs:
        t0 = time.thread_time_ns()
        conn.execute("BEGIN IMMEDIATE")
        t1 = time.thread_time_ns()
        for sql, values in statements:
            cursor = conn.execute(sql, values)
            if cursor.description is not None:
                cursor.fetchall()
        t2 = time.thread_time_ns()
        conn.execute(end)
        t3 = time.thread_time_ns()
        grown = wal.stat().st_size
        by_kind[_kind(statements)].append((t1 - t0, t2 - t1, t3 - t2, grown - size))
        size = grown
    conn.close()
    return by_kind


def _migrated(path: Path) -> None:
    """A new SQLite file at ``path`` with the product's schema."""
    from core.settings import Settings
    from core.storage import Storage

    async def migrate() -> None:
        storage = Storage.open(Settings(database_url=f"sqlite:///{path}"))
        try:
            await storage.migrate()
        finally:
            await storage.dispose()

    asyncio.run(migrate())


def run_part(argv: list[str]) -> None:
    """``slack-agent bench write-replay TRACE [ROUNDS]`` (three rounds unless told)."""
    txs = transactions(Path(argv[0]))
    rounds = int(argv[1]) if len(argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        schema, into = Path(tmp) / "schema.db", Path(tmp) / "replay.db"
        _migrated(schema)
        page = _connect(schema, checkpoints=True).execute("PRAGMA page_size").fetchone()
        frame = int(page[0]) + 24
        for checkpoints in [True] * rounds + [False]:
            by_kind = replay(txs, schema, into, checkpoints=checkpoints)
            every = [t for ts in by_kind.values() for t in ts]
            n = len(every)
            begin, statements, commit = (sum(t[i] for t in every) / n / 1000 for i in range(3))
            # A checkpoint starts the WAL again from its beginning: pages counted without.
            wal = "" if checkpoints else f"; {sum(t[3] for t in every) / frame / n:.2f} WAL pages"
            label = "automatic checkpoints" if checkpoints else "no checkpoints"
            print(
                f"{n} transactions ({label}): {begin + statements + commit:.1f} µs each: "
                f"begin {begin:.1f}, statements {statements:.1f}, commit {commit:.1f}{wal}"
            )
        print("by kind (the last round): count, median µs, mean WAL pages")
        for kind, ts in sorted(by_kind.items(), key=lambda kv: -sum(sum(t[:3]) for t in kv[1])):
            median = statistics.median(sum(t[:3]) for t in ts) / 1000
            pages = sum(t[3] for t in ts) / frame / len(ts)
            print(f"  {len(ts):6d}  {median:6.1f}  {pages:5.2f}  {kind[:100]}")
