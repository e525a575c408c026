"""Two benchmarks of one ``slack-agent serve`` replica under load, each with the real app in a
child process, the Slack stand-in in another, and the load and the clock in this one.

``concurrent_turns`` (N = 10, 100, 500): N mentions, each a new thread, against a stand-in model
that streams every answer for ``stream_seconds`` (``standins.openai.SlowModel``, in its own
process), with ``MAX_CONCURRENT_TURNS`` = N + the probe events. Once the model sees N calls in
flight:

- ``rss_per_active_turn_bytes``: the replica's resident memory then, less its memory before the
  wave (after one warm-up turn), divided by N;
- ``ack``: ``probes`` more mentions sent one every 100 ms while the N turns stream, each timed to
  its HTTP answer (p50 / p95 / p99 / max, ms);
- ``cpu_ms_per_turn``: the replica's CPU time (user + system) from the first mention until every
  model call has ended and the replica is idle again, divided by the turns run: everything the
  replica does for a turn (the acknowledgement, the delivery record, the claim, relaying the
  stream to Slack, the release) except waiting for the model;
- ``seconds_to_all_running``: from the first mention sent to N model calls in flight;
- ``turns_started_per_second``: the wave's N turns over the time until all of them had called
  the model: the replica's start rate. N run at once only if N start within one answer's time
  (``stream_seconds``, 20 s; ``--stream-seconds=S`` on the command line); if not, the probes
  meet the tail of the wave, not N turns;
- ``messages_shed``: mentions the replica recorded for another replica with room instead of
  keeping them (``MAX_HELD_MESSAGES``, raised to the wave's size here): 0, or the wave was not
  N turns at once.

``--floor`` runs the same waves against ``bench.load.floor``, a server that makes only a
turn's I/O with the same libraries: its ``cpu_ms_per_turn`` is the floor under the replica's.

``ack_during_fork_and_sweep`` (SQLite or the PostgreSQL given): a session of 10,000 messages
bound to a Slack thread, and ``sweep_sessions`` expired temporary sessions inserted while the
replica runs, due 3 s later (its sweeper runs every 2 s). Probe mentions go every ``spacing``
seconds (100 ms) for ``window_seconds``; one
second in, the *Fork* shortcut is sent for the session's last message (the copy runs in the
replica), and the sweeper's next pass deletes the expired sessions. Reported: the probes' ack
percentiles, the same probes with nothing else running (``ack_baseline``), and checks that the
fork and the sweep did happen within the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
import time
import uuid
from asyncio.subprocess import Process
from pathlib import Path
from typing import Any, Final, NamedTuple
from urllib.parse import urlencode

import aiohttp
from sqlalchemy import func, insert, select

from bench.common import (
    SECRET,
    EventConnection,
    cpu_times,
    percentiles,
    request_bytes,
    rss_bytes,
    serve_process,
    standin_process,
    stop_process,
    transcript,
)
from bench.costs.storage import MESSAGES, SESSIONS, _message_row
from bench.load.counts import read_counts
from bot.post import PROJECT, SURFACE, thread_key
from core.settings import Settings
from core.storage import Storage
from core.storage.dialect import hence
from core.storage.engine import create_database
from standins import metrics
from standins.processes import spawn
from standins.slack import TEAM, signed_headers

SIZES: Final = (10, 100, 500)
PROBE_SPACING: Final = 0.1
CHANNEL: Final = "C0BENCH"


class _Cpu(NamedTuple):
    """A replica's CPU seconds so far: all of it, its main thread's (the turns' event loop),
    and the system time of all of it."""

    total: float
    main: float
    system: float


def _cpu_now(pid: int) -> _Cpu:
    user, system = cpu_times(pid)
    return _Cpu(user + system, sum(cpu_times(pid, pid)), system)


async def _counted(proc: Process, out: Path, answered: int) -> dict[str, int]:
    """``bench.load.counts``'s counters now (SIGUSR2, then its ``answered``-th write)."""
    proc.send_signal(signal.SIGUSR2)
    for _ in range(200):
        counts = read_counts(out)
        if counts.get("answered", 0) >= answered:
            return counts
        await asyncio.sleep(0.05)
    raise RuntimeError("the replica did not write its counts")


def _per_turn(before: dict[str, int], after: dict[str, int], turns: int) -> dict[str, float]:
    return {
        key: round((after.get(key, 0) - before.get(key, 0)) / max(1, turns), 1)
        for key in sorted(set(after) - {"answered"})
    }


async def _model_process(seconds: float) -> tuple[Process, str]:
    return await spawn("standins.openai", str(seconds))


async def _stats(http: aiohttp.ClientSession, model_url: str) -> dict[str, int]:
    async with http.get(f"{model_url}/stats") as response:
        return dict(await response.json())


async def _shed(http: aiohttp.ClientSession, port: int) -> int:
    """The replica's ``slack_agent_messages_shed_total``, from its ``/metrics``."""
    samples = await metrics.scrape(f"http://127.0.0.1:{port}", http)
    if ("slack_agent_messages_shed_total", ()) not in samples:
        raise RuntimeError("the replica's /metrics has no slack_agent_messages_shed_total")
    return int(metrics.value(samples, "slack_agent_messages_shed_total"))


async def _wait_for(
    check: Any, http: aiohttp.ClientSession, model_url: str, within: float
) -> dict[str, int]:
    deadline = time.monotonic() + within
    while True:
        stats = await _stats(http, model_url)
        if check(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


class _Clock:
    """Unique message timestamps for this run's events."""

    def __init__(self) -> None:
        self.base = int(time.time())
        self.n = 0

    def next(self) -> str:
        self.n += 1
        return f"{self.base}.{self.n:06d}"


async def _send_all(
    port: int, connections: list[EventConnection], raws: list[bytes]
) -> list[float]:
    """Every request, spread over the connections (each sends its share one after another)."""
    shares: list[list[bytes]] = [[] for _ in connections]
    for i, raw in enumerate(raws):
        shares[i % len(connections)].append(raw)

    async def one(c: EventConnection, mine: list[bytes]) -> list[float]:
        return [await c.send(raw) for raw in mine]

    results = await asyncio.gather(*(one(c, s) for c, s in zip(connections, shares, strict=True)))
    return [x for r in results for x in r]


async def _probe(
    connections: list[EventConnection], raws: list[bytes], spacing: float = PROBE_SPACING
) -> list[float]:
    """One request every ``spacing`` seconds, each on its own warm connection, each timed."""

    async def at(i: int, c: EventConnection, raw: bytes) -> float:
        await asyncio.sleep(i * spacing)
        return await c.send(raw)

    return list(
        await asyncio.gather(
            *(at(i, c, raw) for i, (c, raw) in enumerate(zip(connections, raws, strict=True)))
        )
    )


def replica_env(turns: int, model_url: str) -> dict[str, str]:
    """The replica's settings for a wave of ``turns``: all of them run at once. Both limits
    are raised: past ``MAX_HELD_MESSAGES`` (256 by default) a replica records new messages for
    any replica with room and takes them back only as its own turns end, so a wave of 550
    ran about 100 at once, started 7 a second, and measured another thing (2026-12-05)."""
    return {
        "MODEL_PROVIDER": "openai",
        "OPENAI_API_KEY": "sk-bench",
        "OPENAI_BASE_URL": f"{model_url}/v1",
        "MAX_CONCURRENT_TURNS": str(turns),
        "MAX_HELD_MESSAGES": str(turns),
        "BUSY_MODE": "queue",
    }


async def _concurrent(
    n: int,
    database_url: str | None,
    *,
    stream_seconds: float,
    probes: int,
    counts: bool = False,
    floor: bool = False,
) -> dict[str, Any]:
    """One wave; ``counts``: the replica runs under ``bench.load.counts`` and what it did per
    turn is reported (``per_turn``, ``cpu_split``); ``floor``: ``bench.load.floor`` stands
    where the replica would, doing only a turn's I/O."""
    counted: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts.json"
        floored = ("bench.load.floor",) if floor else ()
        command = ("-m", *(floored or ("bot", "serve")))
        if counts:
            command = ("-m", "bench.load.counts", str(out), *floored)
        url = database_url or f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        standin, api_url = await standin_process()
        model, model_url = await _model_process(stream_seconds)
        env = replica_env(n + probes, model_url)
        proc: Process | None = None
        try:
            proc, port = await serve_process(url, api_url, tmp, env, command)
            clock = _Clock()
            async with aiohttp.ClientSession() as http:
                warm = await EventConnection.open(port)  # one turn first: imports, caches, pools
                await warm.send(request_bytes(port, clock.next()))
                await _wait_for(lambda s: s["finished"] >= 1, http, model_url, 60)
                await asyncio.sleep(1.0)
                idle_rss = rss_bytes(proc.pid)
                base = await _stats(http, model_url)
                wave = [await EventConnection.open(port) for _ in range(min(n, 100))]
                probe = [await EventConnection.open(port) for _ in range(probes)]
                if counts:
                    counted.append(await _counted(proc, out, 1))
                cpu_start = _cpu_now(proc.pid)
                started = time.perf_counter()
                wave_acks = await _send_all(
                    port, wave, [request_bytes(port, clock.next()) for _ in range(n)]
                )
                stats = await _wait_for(
                    lambda s: s["in_flight"] >= n or s["started"] >= base["started"] + n,
                    http,
                    model_url,
                    stream_seconds * 4,
                )
                # The wave's start rate: how fast this replica brings turns to their model
                # call (its CPU per turn sets it); N run at once only if N start within one
                # answer's time.
                to_all_started = time.perf_counter() - started
                wave_started = stats["started"] - base["started"]
                to_all_running = time.perf_counter() - started
                running = stats["in_flight"]
                active_rss = max(rss_bytes(proc.pid) for _ in range(3))
                probe_acks = await _probe(
                    probe, [request_bytes(port, clock.next()) for _ in range(probes)]
                )
                during = await _stats(http, model_url)
                total = base["finished"] + base["failed"] + n + probes
                done = await _wait_for(
                    lambda s: s["finished"] + s["failed"] >= total and s["in_flight"] == 0,
                    http,
                    model_url,
                    stream_seconds * 6 + 60,
                )
                await asyncio.sleep(1.0)  # the last replies' final Slack updates and releases
                cpu_end = _cpu_now(proc.pid)
                shed = await _shed(http, port)
                if counts:
                    counted.append(await _counted(proc, out, 2))
                for c in [warm, *wave, *probe]:
                    c.close()
        finally:
            if proc is not None:
                await stop_process(proc)
            await stop_process(model)
            await stop_process(standin)
    turns = done["finished"] + done["failed"] - base["finished"] - base["failed"]
    cpu = cpu_end.total - cpu_start.total
    used = max(cpu, 1e-9)
    # The kernel adjusts a thread's and the process's times (each a user/system split of its
    # own run time, kept monotonic) separately: over a wave of a few ticks the main thread's
    # can come out above the process's (seen: a share of 1.25), so the share is capped.
    main_share = min(1.0, (cpu_end.main - cpu_start.main) / used)
    extra: dict[str, Any] = {
        # Shares of the replica's CPU over the wave: its main thread (the turns' loop), every
        # other thread (the intake's loop, to_thread workers), and of the total, system time.
        "cpu_split": {
            "turns_loop": round(main_share, 3),
            "other_threads": round(1 - main_share, 3),
            "system": round((cpu_end.system - cpu_start.system) / used, 3),
        }
    }
    if counts:
        extra["per_turn"] = _per_turn(counted[0], counted[1], turns)
    return extra | {
        "turns": n,
        "running_at_once": running,
        "running_during_probes": during["in_flight"],
        "seconds_to_all_running": round(to_all_running, 2) if running >= n else None,
        "turns_started_per_second": round(wave_started / to_all_started, 1),
        "ack": percentiles(probe_acks) | {"max": round(max(probe_acks), 3)},
        "ack_of_the_wave": percentiles(wave_acks),
        "idle_rss_bytes": idle_rss,
        # Only meaningful once the N turns did run at once; absent (None) otherwise.
        "rss_per_active_turn_bytes": (
            round((active_rss - idle_rss) / running) if running >= n else None
        ),
        "cpu_ms_per_turn": round(cpu * 1000 / max(1, turns), 2),
        "model_calls_failed": done["failed"] - base["failed"],
        # Mentions the replica recorded for a replica with room (MAX_HELD_MESSAGES): 0, or the
        # wave was not the one described.
        "messages_shed": shed,
    }


async def bench_concurrent_turns(
    database_url: str | None = None,
    *,
    sizes: tuple[int, ...] = SIZES,
    stream_seconds: float = 20.0,
    probes: int = 50,
    counts: bool = False,
    floor: bool = False,
) -> dict[str, Any]:
    """``concurrent_turns``: one fresh replica per N (module docstring); ``floor``: the same
    waves against ``bench.load.floor``."""
    result: dict[str, Any] = {"stream_seconds": stream_seconds, "load_start": os.getloadavg()}
    for n in sizes:
        result[str(n)] = await _concurrent(
            n,
            database_url,
            stream_seconds=stream_seconds,
            probes=probes,
            counts=counts,
            floor=floor,
        )
    result["load_end"] = os.getloadavg()
    return result


# -- acknowledgements while a fork and a sweep run ------------------------------------------------


def _shortcut_request(port: int, message_ts: str) -> bytes:
    payload = {
        "type": "message_action",
        "callback_id": "fork_session",
        "trigger_id": "1.2.3",
        "team": {"id": TEAM, "domain": "bench"},
        "channel": {"id": CHANNEL, "name": "bench"},
        "user": {"id": "U0BENCH", "team_id": TEAM},
        "message": {"type": "message", "ts": message_ts, "text": "fork here"},
        "message_ts": message_ts,
        "response_url": "http://127.0.0.1:9/none",
    }
    body = urlencode({"payload": json.dumps(payload)})
    headers = signed_headers(body, secret=SECRET, content_type="application/x-www-form-urlencoded")
    lines = [
        "POST /slack/events HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Content-Length: {len(body.encode())}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


async def _long_thread(url: str, messages: int) -> str:
    """A session of ``messages`` messages bound to a Slack thread; the ts of its last message."""
    storage = Storage.open(Settings(database_url=url))
    try:
        await storage.migrate()
        store = storage.sessions
        root = f"{int(time.time()) - 100}.000001"
        key = thread_key(TEAM, CHANNEL, root)
        session, _ = await store.get_or_create_session(PROJECT, key, user_id=None)
        rows = transcript(0, messages)
        for i in range(0, len(rows), 2000):
            await store.import_messages(session.id, rows[i : i + 2000])
        tail = await store.tail(session.id)
        assert tail is not None
        state = storage.surface(SURFACE)
        await state.bind_thread(key, session.id, tail.message_id)
        last_ts = f"{int(time.time()) - 50}.000001"
        await state.add_ref(thread_key(TEAM, CHANNEL, last_ts), session.id, tail.message_id, "user")
        return last_ts
    finally:
        await storage.dispose()


async def _expire(url: str, count: int, in_seconds: float) -> None:
    """``count`` temporary sessions of 4 messages that expire ``in_seconds`` from now, each
    slice written with its messages in one transaction (so the replica's sweeper never sees a
    session without its messages)."""
    db = create_database(url)
    try:
        for chunk in range(0, count, 500):
            prefix = f"sweep/{uuid.uuid4().hex[:8]}/"
            async with db.write() as conn:
                await conn.execute(
                    insert(SESSIONS).values(expires_at=hence(in_seconds)),
                    [
                        {"project_name": "bench", "project_session_id": f"{prefix}{i}"}
                        for i in range(min(500, count - chunk))
                    ],
                )
                ids = (
                    await conn.scalars(
                        select(SESSIONS.c.id).where(
                            SESSIONS.c.project_session_id.startswith(prefix)
                        )
                    )
                ).all()
                await conn.execute(
                    insert(MESSAGES),
                    [
                        _message_row(session_id, position, message)
                        for session_id in ids
                        for position, (message, _) in enumerate(transcript(0, 4))
                    ],
                )
    finally:
        await db.dispose()


async def _counts(url: str, messages: int) -> tuple[int, int]:
    """(sessions of the Slack project with ``messages`` messages or more, expired ones left)."""
    db = create_database(url)
    try:
        async with db.read() as conn:
            sizes = (
                await conn.scalars(
                    select(func.count())
                    .select_from(MESSAGES.join(SESSIONS, MESSAGES.c.session_id == SESSIONS.c.id))
                    .where(SESSIONS.c.project_name == PROJECT)
                    .group_by(MESSAGES.c.session_id)
                )
            ).all()
            expired = await conn.scalar(
                select(func.count()).select_from(SESSIONS).where(SESSIONS.c.project_name == "bench")
            )
        return sum(1 for s in sizes if s >= messages), int(expired or 0)
    finally:
        await db.dispose()


async def bench_ack_during_fork_and_sweep(
    database_url: str | None = None,
    *,
    fork_messages: int = 10_000,
    sweep_sessions: int = 10_000,
    window_seconds: float = 6.0,
    spacing: float = 0.1,
) -> dict[str, Any]:
    """``ack_during_fork_and_sweep`` (module docstring)."""
    probes = int(window_seconds / spacing)
    with tempfile.TemporaryDirectory() as tmp:
        url = database_url or f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        last_ts = await _long_thread(url, fork_messages)
        standin, api_url = await standin_process()
        env = {
            "MODEL_PROVIDER": "offline",
            "SWEEPER_INTERVAL_SECONDS": "2",
            "SWEEPER_JITTER_SECONDS": "0",
            # Expired sessions only: the probes' many sessions of one user must not be
            # deleted by the per-user cap while their turns start.
            "AGENT_SESSION_MAX_PER_USER": "0",
            "AGENT_SESSION_MAX_IDLE_DAYS": "0",
        }
        proc: Process | None = None
        try:
            proc, port = await serve_process(url, api_url, tmp, env)
            clock = _Clock()
            connections = [await EventConnection.open(port) for _ in range(probes)]
            await _send_all(port, connections[:20], [request_bytes(port, clock.next())] * 1)
            await asyncio.sleep(2.0)
            baseline = await _probe(
                connections, [request_bytes(port, clock.next()) for _ in range(probes)], spacing
            )
            await asyncio.sleep(2.0)
            await _expire(url, sweep_sessions, in_seconds=3.0)
            shortcut = await EventConnection.open(port)

            async def fork_after(delay: float) -> float:
                await asyncio.sleep(delay)
                return await shortcut.send(_shortcut_request(port, last_ts))

            loaded, fork_ack = await asyncio.gather(
                _probe(
                    connections, [request_bytes(port, clock.next()) for _ in range(probes)], spacing
                ),
                fork_after(1.0),
            )
            await asyncio.sleep(2.0)
            for c in [*connections, shortcut]:
                c.close()
        finally:
            if proc is not None:
                await stop_process(proc)
            await stop_process(standin)
        forks, expired_left = await _counts(url, fork_messages)
    return {
        "fork_messages": fork_messages,
        "sweep_sessions": sweep_sessions,
        "ack": percentiles(loaded) | {"max": round(max(loaded), 3)},
        "ack_baseline": percentiles(baseline) | {"max": round(max(baseline), 3)},
        "fork_ack_ms": round(fork_ack, 3),
        "fork_done": forks >= 2,
        "sweep_done": expired_left == 0,
    }


def format_lines(result: dict[str, Any]) -> list[str]:
    """``concurrent_turns`` and ``ack_during_fork_and_sweep`` of a bench result, for people."""
    lines: list[str] = []
    turns = result.get("concurrent_turns")
    if isinstance(turns, dict):
        lines += [
            "",
            f"concurrent_turns (model streams {turns['stream_seconds']:g} s; ack of mentions "
            "sent every 100 ms while the turns stream):",
        ]
        for key, row in turns.items():
            if not key.isdigit():
                continue
            ack = row["ack"]
            reached = row["seconds_to_all_running"]
            lines.append(
                f"  N={int(key):>4}: {row['running_at_once']:>4} running at once"
                + (f" after {reached:.1f} s" if reached is not None else "")
                + f" (started {row['turns_started_per_second']:.0f}/s); "
                f"ack p50/p95/p99 {ack['p50']:.1f} / "
                f"{ack['p95']:.1f} / {ack['p99']:.1f} ms; "
                f"{row['cpu_ms_per_turn']:.1f} ms CPU per turn"
                + (f"; {row['messages_shed']} SHED" if row.get("messages_shed") else "")
                + (
                    "; N never ran at once"
                    if row["rss_per_active_turn_bytes"] is None
                    else f"; {row['rss_per_active_turn_bytes'] / 1024:,.0f} KiB per active turn"
                )
            )
            split = row["cpu_split"]
            lines.append(
                f"         CPU: turns' loop {split['turns_loop']:.0%}, other threads "
                f"{split['other_threads']:.0%}; system {split['system']:.0%}"
            )
            if "per_turn" in row:
                lines.append(
                    "         per turn: "
                    + ", ".join(f"{k} {v:g}" for k, v in row["per_turn"].items())
                )
    fork = result.get("ack_during_fork_and_sweep")
    if isinstance(fork, dict):
        ack, base = fork["ack"], fork["ack_baseline"]
        lines += [
            "",
            f"ack while a {fork['fork_messages']:,}-message fork and a sweep of "
            f"{fork['sweep_sessions']:,} sessions run: p50/p95/p99 {ack['p50']:.1f} / "
            f"{ack['p95']:.1f} / {ack['p99']:.1f} ms (max {ack['max']:.1f}); with neither "
            f"{base['p50']:.1f} / {base['p95']:.1f} / {base['p99']:.1f} ms; fork done: "
            f"{fork['fork_done']}, sweep done: {fork['sweep_done']}",
        ]
    return lines


def run_part(argv: list[str]) -> None:
    """``slack-agent bench turns [DATABASE_URL [SIZES]] [--counts | --floor]
    [--stream-seconds=S]`` | ``slack-agent bench fork [DATABASE_URL]``."""
    counting = "--counts" in argv
    flooring = "--floor" in argv
    streamed = [a for a in argv if a.startswith("--stream-seconds=")]
    stream_seconds = float(streamed[-1].partition("=")[2]) if streamed else 20.0
    args = ["", *(a for a in argv if a not in ("--counts", "--floor") and a not in streamed)]
    what = args[1] if len(args) > 1 else "turns"
    target = args[2] if len(args) > 2 else None
    if what == "fork":
        print(json.dumps(asyncio.run(bench_ack_during_fork_and_sweep(target))))
    else:
        sizes = tuple(int(x) for x in args[3].split(",")) if len(args) > 3 else SIZES
        with contextlib.suppress(KeyboardInterrupt):
            result = bench_concurrent_turns(
                target or None,
                sizes=sizes,
                counts=counting,
                floor=flooring,
                stream_seconds=stream_seconds,
            )
            print(json.dumps(asyncio.run(result)))
