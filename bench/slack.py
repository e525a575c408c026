"""Benchmark of the Slack surface (the keys ``ack`` and ``idle_rss_bytes``).

``bench_ack``: the real app (``Bot``) serving HTTP on 127.0.0.1 against the local Slack
stand-in, with the offline model; first a wave of mentions starts turns, then 100 signed events
are sent at once while those turns run, and each one's time to its HTTP response (Slack's 3 s
acknowledgement) is measured. ``idle_rss_bytes``: resident memory of a ``slack-agent serve``
process that has migrated and answered its health check, then sat idle.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from asyncio.subprocess import Process
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.testing.processes import child_environment, free_port, spawn, until_healthy
from core.testing.slack import BOT_USER, TEAM, signed_headers

SECRET = "bench-signing-secret"


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
    proc, url = await spawn("core.testing.slack")
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


class Connection:
    """One keep-alive connection, as Slack holds them: write a request, time its answer.

    A plain stream rather than an HTTP client library, so the client's own per-request work
    (which would run on the measuring loop) is not counted as the server's latency.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
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


async def _measure(
    database_url: str | None, *, events: int, settle_seconds: float
) -> dict[str, Any]:
    """One ``slack-agent serve`` child: its idle RSS, then ack latency under load.

    The load comes from this process, as Slack's requests come from elsewhere: a wave of 20
    mentions starts turns, then ``events`` signed mentions are sent at once on warm connections
    and each one's time to its HTTP response is measured.
    """
    with tempfile.TemporaryDirectory() as tmp:
        url = database_url or f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        standin, api_url = await standin_process()
        proc, port = await serve_process(url, api_url, tmp)
        try:
            await asyncio.sleep(settle_seconds)
            rss = rss_bytes(proc.pid)
            base = int(time.time())
            # Warm connections (as many as the measured wave uses) and the authorisation
            # cache; then a wave of turns running while the measured wave arrives.
            connections = [await Connection.open(port) for _ in range(events)]
            try:
                await asyncio.gather(
                    *(
                        c.send(request_bytes(port, f"{base}.{i:06d}"))
                        for i, c in enumerate(connections)
                    )
                )
                await asyncio.gather(
                    *(
                        c.send(request_bytes(port, f"{base + 1}.{i:06d}"))
                        for i, c in enumerate(connections[:20])
                    )
                )
                wave = [request_bytes(port, f"{base + 2}.{i:06d}") for i in range(events)]
                samples = await asyncio.gather(
                    *(c.send(raw) for c, raw in zip(connections, wave, strict=True))
                )
            finally:
                for c in connections:
                    c.close()
        finally:
            await stop_process(proc)
            await stop_process(standin)
    return {"ack": percentiles(list(samples)), "idle_rss_bytes": rss}


async def bench_ack(database_url: str | None = None, *, events: int = 100) -> dict[str, Any]:
    """``ack``: ms from sending to the HTTP answer, ``events`` signed events at once."""
    result = await _measure(database_url, events=events, settle_seconds=0.5)
    return {"ack": result["ack"]}


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


async def idle_rss_bytes(database_url: str | None = None, *, settle_seconds: float = 2.0) -> int:
    """``idle_rss_bytes``: an idle ``slack-agent serve`` (HTTP, sweeper thread on)."""
    result = await _measure(database_url, events=1, settle_seconds=settle_seconds)
    return int(result["idle_rss_bytes"])


async def bench_slack(database_url: str | None = None, *, events: int = 100) -> dict[str, Any]:
    """Both keys from one serve process, for ``slack-agent bench`` to merge."""
    return await _measure(database_url, events=events, settle_seconds=2.0)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(bench_slack(sys.argv[1] if len(sys.argv) > 1 else None))))
