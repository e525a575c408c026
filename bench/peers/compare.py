"""``slack-agent bench --compare``: slack-agent's storage against its peers, one workload for all.

For each contender and each N (100, 1,000, 10,000; ``--quick``: 100, 1,000), in a fresh
database of its own (a new SQLite file, or a new PostgreSQL database on the server given):

- ``append``: a conversation of N messages (user and assistant in turn) appended one at a
  time, each timed; ours inside full locked, guarded turns, as the product stores them (a
  question opens a turn, its answer closes it: ``bench.peers.conversation``), a peer with its bare
  append;
- ``load``: the whole history loaded after every 100 messages (each checked for its length);
- ``bytes_per_message``: what the N messages added to the database's files (SQLite: the file
  after the last connection closed; PostgreSQL: ``pg_database_size``), divided by N;
- ``writers``: 50 writers at once on one conversation, each storing a question, "thinking"
  5 ms, and storing its answer: how many were inside their turn at once (``most_at_once``),
  whether every message is kept, and how many writers' question and answer ended up apart.

Contenders alternate within the run (the order rotates each round) so a burst of load on the
shared machine weighs on all alike. Timings are ``{"p50", "p95", "n"}`` in milliseconds, and the
ratios are ours / peer at p50, per database and N.

LangGraph's savers store the whole messages list in every checkpoint, so its storage and its
append time grow with N: a size whose total stored copies (N(N+1)/2 messages) would pass
``QUADRATIC_LIMIT`` is skipped and said so, rather than filling the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import asyncpg
from sqlalchemy.engine import make_url

from bench.common import ASSISTANT_TEXT, USER_TEXT, BenchError, summarize
from bench.peers import libraries as peers
from bench.peers.conversation import Item, PeerConversation, ours

QUADRATIC_LIMIT: Final = 2_000_000  # message copies a quadratic contender may store in one run
INSTALL_HINT: Final = "uv sync --extra compare"

Opener = Callable[[str, str], AbstractAsyncContextManager[PeerConversation]]


@dataclass(frozen=True)
class CompareSizes:
    sizes: tuple[int, ...]
    rounds: dict[int, int]  # N -> rounds (the contenders alternate within each)
    load_every: int
    writers: int
    think_seconds: float


FULL: Final = CompareSizes((100, 1000, 10_000), {100: 3, 1000: 2, 10_000: 1}, 100, 50, 0.005)
QUICK: Final = CompareSizes((100, 1000), {100: 2, 1000: 1}, 100, 50, 0.005)


@dataclass(frozen=True)
class Contender:
    name: str
    database: str  # "sqlite" or "postgresql"
    open: Opener
    locator: str  # "sqlalchemy" (an async SQLAlchemy URL) or "plain" (a path or a libpq URL)
    quadratic: bool = False


def contenders(*, include_peers: bool = True) -> list[Contender]:
    found = [
        Contender("slack-agent", "sqlite", ours, "sqlalchemy"),
        Contender("slack-agent", "postgresql", ours, "sqlalchemy"),
    ]
    if include_peers:
        found += [
            Contender("agents SQLiteSession", "sqlite", peers.agents_sqlite, "plain"),
            Contender("agents SQLAlchemySession", "sqlite", peers.agents_sqlalchemy, "sqlalchemy"),
            Contender(
                "agents SQLAlchemySession", "postgresql", peers.agents_sqlalchemy, "sqlalchemy"
            ),
            Contender(
                "langgraph AsyncSqliteSaver", "sqlite", peers.langgraph_sqlite, "plain", True
            ),
            Contender(
                "langgraph AsyncPostgresSaver",
                "postgresql",
                peers.langgraph_postgres,
                "plain",
                True,
            ),
        ]
    return found


# -- places: a fresh database per measurement -----------------------------------------------------


class Site(Protocol):
    def locator(self, kind: str) -> str: ...
    async def size(self) -> int: ...


class _SqlitePlace:
    def __init__(self, directory: Path) -> None:
        self.path = directory / "conversation.db"

    def locator(self, kind: str) -> str:
        return f"sqlite+aiosqlite:///{self.path}" if kind == "sqlalchemy" else str(self.path)

    async def size(self) -> int:
        return sum(p.stat().st_size for p in self.path.parent.iterdir() if p.is_file())


class _PostgresPlace:
    def __init__(self, server_url: str, name: str) -> None:
        self.url = make_url(server_url).set(database=name)

    def locator(self, kind: str) -> str:
        driver = "postgresql+asyncpg" if kind == "sqlalchemy" else "postgresql"
        return self.url.set(drivername=driver).render_as_string(hide_password=False)

    async def size(self) -> int:
        conn = await asyncpg.connect(self.locator("plain"))
        try:
            return int(await conn.fetchval("SELECT pg_database_size(current_database())"))
        finally:
            await conn.close()


async def _admin(server_url: str, statement: str) -> None:
    dsn = make_url(server_url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def _place(database: str, server_url: str | None) -> AsyncIterator[Site]:
    if database == "sqlite":
        directory = Path(tempfile.mkdtemp(prefix="slack-agent-compare-"))
        try:
            yield _SqlitePlace(directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    assert server_url is not None
    name = f"bench_compare_{uuid.uuid4().hex[:12]}"
    await _admin(server_url, f'CREATE DATABASE "{name}"')
    try:
        yield _PostgresPlace(server_url, name)
    finally:
        await _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the workload ---------------------------------------------------------------------------------


def items(n: int) -> list[Item]:
    return [
        Item("user", f"{USER_TEXT} ({i})")
        if i % 2 == 0
        else Item("assistant", f"{ASSISTANT_TEXT} ({i})")
        for i in range(n)
    ]


@dataclass
class _Appends:
    append: list[float]
    load: list[float]
    load_at_end: list[float]
    bytes_per_message: list[float]


async def _conversation(
    contender: Contender, place: Site, n: int, load_every: int, into: _Appends
) -> None:
    name = f"conversation-{uuid.uuid4().hex[:8]}"
    locator = place.locator(contender.locator)
    async with contender.open(locator, name) as conversation:  # tables and the empty conversation
        await conversation.load()
    before = await place.size()
    last_load = 0.0
    async with contender.open(locator, name) as conversation:
        for i, item in enumerate(items(n), start=1):
            started = time.perf_counter()
            await conversation.append(item)
            into.append.append(time.perf_counter() - started)
            if i % load_every == 0 or i == n:
                started = time.perf_counter()
                got = len(await conversation.load())
                last_load = time.perf_counter() - started
                into.load.append(last_load)
                if got != i:
                    raise BenchError(f"{contender.name}: history of {got} messages, not {i}")
    into.load_at_end.append(last_load)
    into.bytes_per_message.append((await place.size() - before) / n)


async def _writers(contender: Contender, place: Site, writers: int, think: float) -> dict[str, Any]:
    inside = most = 0

    async def thinking() -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await asyncio.sleep(think)
        inside -= 1

    async with contender.open(place.locator(contender.locator), "writers") as conversation:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                conversation.turn(
                    Item("user", f"writer {i} asks"),
                    Item("assistant", f"writer {i} answers"),
                    thinking,
                )
                for i in range(writers)
            ),
            return_exceptions=True,
        )
        seconds = time.perf_counter() - started
        history = await conversation.load()
    errors = [r for r in results if isinstance(r, BaseException)]
    apart = sum(
        1
        for i in range(writers)
        if f"writer {i} asks" in history
        and history[history.index(f"writer {i} asks") + 1 : history.index(f"writer {i} asks") + 2]
        != [f"writer {i} answers"]
    )
    kept = len(history)
    return {
        "writers": writers,
        "seconds": round(seconds, 3),
        "most_at_once": most,
        "messages_kept": kept,
        "messages_expected": 2 * writers,
        "writers_split": apart,
        "errors": len(errors),
        "first_error": repr(errors[0])[:200] if errors else None,
        "one_writer_at_a_time": most == 1 and apart == 0 and kept == 2 * writers and not errors,
    }


def _skipped(contender: Contender, n: int) -> str | None:
    if contender.quadratic and n * (n + 1) // 2 > QUADRATIC_LIMIT:
        return (
            f"not run at N={n:,}: it stores the whole conversation in every checkpoint, "
            f"{n * (n + 1) // 2:,} message copies"
        )
    return None


def _key(contender: Contender) -> str:
    return f"{contender.name} [{contender.database}]"


async def run_compare(
    server_url: str | None,
    *,
    quick: bool = False,
    sizes: CompareSizes | None = None,
    chosen: list[Contender] | None = None,
    progress: Callable[[str], Awaitable[None] | None] | None = None,
) -> dict[str, Any]:
    """The comparison (module docstring). PostgreSQL contenders run only given ``server_url``
    (any database on the server; each measurement creates and drops its own database)."""
    plan = sizes or (QUICK if quick else FULL)
    if chosen is None:
        absent = peers.missing()
        if absent:
            return {"skipped": skip_message(absent)}
        chosen = contenders()
    chosen = [c for c in chosen if c.database == "sqlite" or server_url is not None]
    load_start = os.getloadavg()
    started = time.perf_counter()
    appends: dict[tuple[str, int], _Appends] = {}
    skipped: dict[str, dict[str, str]] = {}
    for n in plan.sizes:
        for round_ in range(plan.rounds.get(n, 1)):
            shift = round_ % len(chosen)
            for contender in chosen[shift:] + chosen[:shift]:
                reason = _skipped(contender, n)
                if reason is not None:
                    skipped.setdefault(_key(contender), {})[str(n)] = reason
                    continue
                if progress is not None:
                    await _say(progress, f"{_key(contender)}: N={n:,}, round {round_ + 1}")
                into = appends.setdefault((_key(contender), n), _Appends([], [], [], []))
                async with _place(contender.database, server_url) as place:
                    await _conversation(contender, place, n, plan.load_every, into)
    writers: dict[str, Any] = {}
    for contender in chosen:
        async with _place(contender.database, server_url) as place:
            writers[_key(contender)] = await _writers(
                contender, place, plan.writers, plan.think_seconds
            )
    results: dict[str, Any] = {}
    for (key, n), got in appends.items():
        results.setdefault(key, {})[str(n)] = {
            "append": summarize(got.append),
            "load": summarize(got.load),
            "load_at_end_ms": round(sorted(got.load_at_end)[len(got.load_at_end) // 2] * 1000, 3),
            "bytes_per_message": round(
                sorted(got.bytes_per_message)[len(got.bytes_per_message) // 2]
            ),
        }
    return {
        "sizes": list(plan.sizes),
        "contenders": results,
        "skipped": skipped,
        "writers": writers,
        "ratios": _ratios(chosen, results),
        "load_average": {
            "start": [round(x, 2) for x in load_start],
            "end": [round(x, 2) for x in os.getloadavg()],
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


async def _say(progress: Callable[[str], Awaitable[None] | None], line: str) -> None:
    maybe = progress(line)
    if maybe is not None:
        await maybe


def _ratios(chosen: list[Contender], results: dict[str, Any]) -> dict[str, Any]:
    """Ours / peer at p50 of ``append``, per database and N (absent where either did not run)."""
    ratios: dict[str, Any] = {}
    for database in ("sqlite", "postgresql"):
        mine = results.get(f"slack-agent [{database}]", {})
        for peer in chosen:
            key = _key(peer)
            if peer.database != database or peer.name == "slack-agent" or key not in results:
                continue
            ratios[key] = {
                n: round(mine[n]["append"]["p50"] / theirs["append"]["p50"], 2)
                for n, theirs in results[key].items()
                if n in mine and theirs["append"]["p50"] > 0
            }
    return ratios


def skip_message(absent: list[str]) -> str:
    return (
        "bench --compare skipped: the peers are an optional extra and are not installed "
        f"(missing: {', '.join(absent)}). Install them with `{INSTALL_HINT}`, then run "
        "`uv run --extra compare slack-agent bench --compare`."
    )


def format_compare(result: dict[str, Any]) -> str:
    """The comparison as tables for people."""
    if "skipped" in result and isinstance(result["skipped"], str):
        return str(result["skipped"])
    lines = [
        "slack-agent bench --compare (ms; ours: every message inside a full locked, guarded "
        "turn, a question opening it and its answer closing it)",
        "",
    ]
    header = (
        f"{'contender':<42} {'N':>6}  {'append p50':>10} {'p95':>8}  "
        f"{'load p50':>9} {'p95':>8} {'at N':>8}  {'bytes/msg':>9}  {'ours/peer':>9}"
    )
    lines += [header, "-" * len(header)]
    for key, by_n in result["contenders"].items():
        for n, row in sorted(by_n.items(), key=lambda kv: int(kv[0])):
            ratio = result["ratios"].get(key, {}).get(n)
            append, load = row["append"], row["load"]
            lines.append(
                f"{key:<42} {int(n):>6,}  {append['p50']:>10.3f} {append['p95']:>8.3f}  "
                f"{load['p50']:>9.2f} {load['p95']:>8.2f} {row['load_at_end_ms']:>8.2f}  "
                f"{row['bytes_per_message']:>9,}  {'' if ratio is None else f'{ratio:.2f}x':>9}"
            )
    for key, by_n in result.get("skipped", {}).items():
        for reason in by_n.values():
            lines.append(f"{key}: {reason}")
    lines += ["", "Writers at once on one conversation (question, 5 ms of thinking, answer):"]
    for key, w in result["writers"].items():
        verdict = (
            "one writer at a time" if w["one_writer_at_a_time"] else "NOT one writer at a time"
        )
        lines.append(
            f"  {key:<42} {verdict}: at most {w['most_at_once']} inside a turn at once, "
            f"{w['messages_kept']}/{w['messages_expected']} messages kept, "
            f"{w['writers_split']} writers' question and answer apart, {w['errors']} errors, "
            f"{w['seconds']:.2f} s"
            + (f" (first error: {w['first_error']})" if w["first_error"] else "")
        )
    load = result["load_average"]
    lines.append(
        "load average (1/5/15 min): start "
        + " ".join(f"{x:.2f}" for x in load["start"])
        + ", end "
        + " ".join(f"{x:.2f}" for x in load["end"])
        + f"; run took {result['seconds']} s"
    )
    return "\n".join(lines)
