"""What the benchmarks share, in one place: the texts a benchmark's sessions are made of, how a
timing is summarised, the database a run measures, and the Slack surface run as the product
runs it (``slack-agent serve`` and the Slack stand-in in processes of their own, signed
requests on keep-alive connections, the children's CPU and memory read from ``/proc``).

A benchmark imports these from here and never from another benchmark, so each family
(``costs``, ``load``, ``soak``, ``peers``) can change its own measurements alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

from core.messages import Message, assistant_message, user_message
from core.storage.engine import Database, create_database
from standins.processes import child_environment, free_port, spawn, until_healthy
from standins.slack import BOT_USER, TEAM, signed_headers


class BenchError(RuntimeError):
    """A benchmark invariant failed (e.g. a claim round without exactly one winner)."""


# -- what sessions are made of ------------------------------------------------------------------

USER_TEXT: Final = (
    "Could you look at the failing deploy job and tell me which step broke, and why? "
    "The logs are in the usual place."
)
ASSISTANT_TEXT: Final = (
    "The deploy failed in the migrate step: the new index on agent_session_messages could not "
    "be built because the disk was full. I freed 2 GB by pruning old build caches and re-ran "
    "the job; it passed in 4m12s. Next time, the disk alert at 90% would have caught it, so I "
    "suggest lowering it to 80%."
)


def exchange_message(position: int) -> Message:
    """Even positions are user messages, odd ones assistant answers (a normal transcript)."""
    if position % 2 == 0:
        return user_message(f"{USER_TEXT} ({position})")
    return assistant_message(f"{ASSISTANT_TEXT} ({position})")


def checkpoint_message() -> Message:
    return user_message(
        "Checkpoint. Objectives: fix the deploy. Constraints: none. Decisions: prune caches. "
        "Completed work: re-ran the job. Active work: none. Blockers: none. "
        "Next steps: lower the disk alert. Important details: job 4812, 2 GB freed.",
        checkpoint=True,
    )


def transcript(
    start: int, count: int, *, checkpoint_at: int | None = None
) -> list[tuple[Message, bool]]:
    """``count`` messages for positions ``start``... (a checkpoint at ``checkpoint_at``)."""
    rows: list[tuple[Message, bool]] = []
    for position in range(start, start + count):
        if position == checkpoint_at:
            rows.append((checkpoint_message(), True))
        else:
            rows.append((exchange_message(position), False))
    return rows


# -- timings --------------------------------------------------------------------------------------


def summarize(seconds: Sequence[float]) -> dict[str, Any]:
    """``{"p50", "p95", "n"}`` in milliseconds (3 decimals); p95 by nearest rank."""
    if not seconds:
        raise ValueError("no samples")
    ms = sorted(s * 1000.0 for s in seconds)
    rank = max(1, math.ceil(0.95 * len(ms)))
    return {
        "p50": round(statistics.median(ms), 3),
        "p95": round(ms[rank - 1], 3),
        "n": len(ms),
    }


def percentiles(samples: list[float]) -> dict[str, float | int]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "p50": round(statistics.median(ordered), 3),
        "p95": at(0.95),
        "p99": at(0.99),
        "n": len(ordered),
    }


# -- the database a run measures ----------------------------------------------------------------


@contextlib.asynccontextmanager
async def database(database_url: str | None) -> AsyncIterator[tuple[Database, bool]]:
    """The database to measure, and whether it is the bench's own temporary file."""
    if database_url is not None:
        db = create_database(database_url)
        try:
            yield db, False
        finally:
            await db.dispose()
        return
    directory = Path(tempfile.mkdtemp(prefix="slack-agent-bench-"))
    db = create_database(f"sqlite+aiosqlite:///{directory / 'bench.db'}")
    try:
        yield db, True
    finally:
        await db.dispose()
        shutil.rmtree(directory, ignore_errors=True)


# -- the Slack surface in processes of its own ---------------------------------------------------


SECRET = "bench-signing-secret"


def event_body(ts: str) -> str:
    return json.dumps(
        {
            "team_id": TEAM,
            "api_app_id": "A0BENCH",
            "type": "event_callback",
            "event_id": f"Ev{ts.replace('.', '')}",
            "event_time": int(time.time()),
            "event": {
                "type": "app_mention",
                "user": "U0BENCH",
                "text": f"<@{BOT_USER}> benchmark message {ts}",
                "ts": ts,
                "channel": "C0BENCH",
                "event_ts": ts,
                "channel_type": "channel",
            },
        }
    )


async def standin_process() -> tuple[Process, str]:
    """The Slack stand-in in a process of its own, and its Web API URL."""
    proc, url = await spawn("standins.slack")
    return proc, url + "/api/"


async def serve_process(
    url: str,
    api_url: str,
    cwd: str,
    extra_env: dict[str, str] | None = None,
    command: Sequence[str] = ("-m", "bot", "serve"),
) -> tuple[Process, int]:
    """A ``slack-agent serve`` child on a free port, once its health check answers;
    ``command``: its arguments to Python (a module that runs ``serve`` with recorders)."""
    port = free_port()
    env = child_environment(
        DATABASE_URL=url,
        SLACK_BOT_TOKEN="xoxb-bench",
        SLACK_SIGNING_SECRET=SECRET,
        SLACK_API_URL=api_url,
        MODEL_PROVIDER="offline",
        HOST="127.0.0.1",
        PORT=str(port),
        LOG_LEVEL="WARNING",
    )
    env.update(extra_env or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *command,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    if await until_healthy(url, lambda: proc.returncode is not None, within=60, every=0.1):
        raise RuntimeError("slack-agent serve did not start")
    return proc, port


def request_bytes(port: int, ts: str) -> bytes:
    """A signed Events API request, as bytes on the wire (built before the clock starts)."""
    body = event_body(ts)
    headers = signed_headers(body, secret=SECRET)
    lines = [
        "POST /slack/events HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        f"Content-Length: {len(body.encode())}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n" + body).encode()


class EventConnection:
    """One keep-alive connection, as Slack holds them: write a request, time its answer.

    A plain stream rather than an HTTP client library, so the client's own per-request work
    (which would run on the measuring loop) is not counted as the server's latency.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> EventConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, raw: bytes) -> float:
        started = time.perf_counter()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        elapsed = (time.perf_counter() - started) * 1000
        status = head.split(b" ", 2)[1]
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        if length:
            await self.reader.readexactly(length)
        if status != b"200":
            raise RuntimeError(f"/slack/events answered {status.decode()}")
        return elapsed

    def close(self) -> None:
        self.writer.close()


async def stop_process(proc: Process) -> None:
    if proc.returncode is None:
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 20)
    except TimeoutError:
        proc.kill()
        await proc.wait()


def cpu_times(pid: int, thread: int | None = None) -> tuple[float, float]:
    """User and system CPU seconds of a process (or of one of its threads) so far (``/proc``)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc")
