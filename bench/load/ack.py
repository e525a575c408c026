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
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    EventConnection,
    percentiles,
    request_bytes,
    rss_bytes,
    serve_process,
    standin_process,
    stop_process,
)


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
            connections = [await EventConnection.open(port) for _ in range(events)]
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


async def idle_rss_bytes(database_url: str | None = None, *, settle_seconds: float = 2.0) -> int:
    """``idle_rss_bytes``: an idle ``slack-agent serve`` (HTTP, sweeper thread on)."""
    result = await _measure(database_url, events=1, settle_seconds=settle_seconds)
    return int(result["idle_rss_bytes"])


async def bench_slack(database_url: str | None = None, *, events: int = 100) -> dict[str, Any]:
    """Both keys from one serve process, for ``slack-agent bench`` to merge."""
    return await _measure(database_url, events=events, settle_seconds=2.0)


def run_part(argv: list[str]) -> None:
    """``slack-agent bench ack [DATABASE_URL]``."""
    print(json.dumps(asyncio.run(bench_slack(argv[0] if argv else None))))
