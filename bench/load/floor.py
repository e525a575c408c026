"""The floor under a turn's CPU on this stack: ``concurrent_turns`` against a server that does
only the turn's I/O, with the same libraries and none of the product.

``uv run slack-agent bench turns "" 10 --floor`` starts this module in place of
``slack-agent serve`` (the same environment, port and workload) and measures it the same way.
For each mention it:

- answers the signed request (slack_sdk's ``SignatureVerifier``, aiohttp's server), as Bolt
  does before its acknowledgement;
- runs as many statements as the product's turn: on SQLite ``READS`` reads alone and
  ``WRITES`` write transactions of one statement each (``--counts`` of the product, rounded
  down), inline on one connection; on PostgreSQL ``ROUND_TRIPS`` statements of one round
  trip each (the product's, logged: docs/benchmarks.md), half of them inserts, on an asyncpg
  pool;
- makes the product's Slack calls with slack_sdk's ``AsyncWebClient`` on one shared aiohttp
  session: the agent session's status, ``chat.startStream`` with the first words, an
  ``appendStream`` whenever the words waiting are due by the product's own pacer
  (``bot.reply.StreamPacer``: its interval, longer as more replies stream at once, and the
  longer wait of a small piece), ``chat.stopStream`` with the rest;
- reads the model's answer over aiohttp as server-sent events, one JSON chunk per event.

No lock, no heartbeat, no delivery record, no rendering, no retries, no Bolt, no read timeout
on the model's stream: what is left is what the libraries cost for the calls and bytes the
product's promises require (acknowledge, record, stream the reply while the model writes). The
product's ``cpu_ms_per_turn`` less this is what the product's own machinery costs; this figure
is what no change to that machinery can go below on CPython with aiohttp and slack_sdk.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any, Final

import aiohttp
import asyncpg
from aiohttp import web
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient

from bot.reply import StreamPacer

# The product's turn on SQLite, counted (``--counts``, N = 50 and 100, 2026-12-07): 11.2 reads
# alone, 12.4-12.6 write transactions (the stop poll's 0.2 reads a turn left out).
READS: Final = 11
WRITES: Final = 12
# The product's statements for a mention in a new thread on PostgreSQL (``log_statement`` over
# a wave of 100, 2026-12-07: 23.8 a turn, of which the group-committed delivery insert is 0.34
# and the stop poll 0.3). It was 26 before the claim became one statement.
ROUND_TRIPS: Final = 23


class _Paced:
    """One reply streaming at the pacer's pace: started with its first words, appended to when
    the words waiting are due, stopped with the rest."""

    def __init__(self, client: AsyncWebClient, channel: str, pacer: StreamPacer) -> None:
        self.client = client
        self.channel = channel
        self.pacer = pacer
        self.ts: str | None = None
        self.waiting = ""
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.sending: asyncio.Task[None] | None = None
        self.stopped = False

    async def add(self, thread: str, text: str) -> None:
        self.waiting += text
        if self.ts is None:
            self.pacer.started(self)
            started = await self.client.chat_startStream(
                channel=self.channel, thread_ts=thread, markdown_text=self.waiting
            )
            self.ts, self.waiting, self.last = str(started["ts"]), "", time.monotonic()
        else:
            self._arm()

    def _arm(self) -> None:
        """The timer for the words waiting, unless one is armed or an append is on its way
        (which arms it again as it ends)."""
        if self.stopped or not self.waiting or self.timer is not None:
            return
        if self.sending is None:
            left = self.pacer.wait(len(self.waiting)) - (time.monotonic() - self.last)
            self.timer = asyncio.get_running_loop().call_later(max(0.0, left), self._due)

    def _due(self) -> None:
        self.timer = None
        self.sending = asyncio.create_task(self._append())

    async def _append(self) -> None:
        assert self.ts is not None
        text, self.waiting, self.last = self.waiting, "", time.monotonic()
        try:
            await self.client.chat_appendStream(
                channel=self.channel, ts=self.ts, markdown_text=text
            )
        finally:
            self.sending = None
        self._arm()

    async def stop(self) -> None:
        self.stopped = True
        self.pacer.finished(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.sending is not None:
            await self.sending
        if self.ts is not None:
            await self.client.chat_stopStream(
                channel=self.channel, ts=self.ts, markdown_text=self.waiting
            )


class Floor:
    """The server: the same routes the benchmark uses (``/slack/events``, ``/healthz``,
    ``/metrics``)."""

    def __init__(self, database_url: str, api_url: str, model_url: str, secret: str) -> None:
        self.database_url = database_url
        self.db: sqlite3.Connection | None = None
        self.pool: asyncpg.Pool | None = None
        self.verifier = SignatureVerifier(secret)
        self.api_url = api_url
        self.model_url = model_url
        self.http: aiohttp.ClientSession | None = None
        self.client: AsyncWebClient | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.pacer = StreamPacer()  # as a replica's replies share theirs (``ThreadAnswers``)

    async def open(self, app: web.Application) -> None:
        table = "create table if not exists turn_floor (id {} primary key, body text)"
        if self.database_url.startswith("sqlite"):
            path = self.database_url.split("///", 1)[1]
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            # The product's own settings (``core.storage.engine``): WAL, and a commit that
            # does not wait for the disk. With SQLite's default (FULL) every commit was an
            # fsync, about 2 ms of system CPU a turn the product never pays.
            self.db.execute("pragma journal_mode=wal")
            self.db.execute("pragma synchronous=normal")
            self.db.execute(table.format("integer"))
        else:
            dsn = self.database_url.replace("+asyncpg", "")
            self.pool = await asyncpg.create_pool(dsn, min_size=10, max_size=10)
            await self.pool.execute(table.format("bigserial"))
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.client = AsyncWebClient(token="xoxb-floor", base_url=self.api_url, session=self.http)

    async def close(self, app: web.Application) -> None:
        if self.http is not None:
            await self.http.close()
        if self.pool is not None:
            await self.pool.close()

    async def events(self, request: web.Request) -> web.Response:
        body = (await request.read()).decode()
        if not self.verifier.is_valid_request(body, dict(request.headers)):
            return web.Response(status=401)
        event = json.loads(body)["event"]
        task = asyncio.create_task(self.turn(event))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return web.Response(text="")

    async def statements(self, half: int, key: str) -> None:
        """Half (0 or 1) of a turn's statements."""
        if self.db is not None:
            row = 0
            for _ in range(WRITES // 2 if half == 0 else WRITES - WRITES // 2):
                self.db.execute("begin immediate")
                cursor = self.db.execute("insert into turn_floor (body) values (?)", (key,))
                row = cursor.lastrowid or 0
                self.db.execute("commit")
            # By key, as every read of the product's turn is (an unindexed read scanned the
            # table, a cost that grew with every turn the run had made).
            for _ in range(READS // 2 if half == 0 else READS - READS // 2):
                read = "select id, body from turn_floor where id = ?"
                self.db.execute(read, (row,)).fetchall()
            return
        assert self.pool is not None
        async with self.pool.acquire() as conn:
            row = 0
            for i in range(ROUND_TRIPS // 2 if half == 0 else ROUND_TRIPS - ROUND_TRIPS // 2):
                if i % 2 == 0:
                    insert = "insert into turn_floor (body) values ($1) returning id"
                    row = await conn.fetchval(insert, key)
                else:
                    await conn.fetch("select id, body from turn_floor where id = $1", row)

    async def turn(self, event: dict[str, Any]) -> None:
        assert self.client is not None
        assert self.http is not None
        channel, thread = event["channel"], event["ts"]
        await self.statements(0, thread)
        await self.client.agents_sessions_setStatus(
            channel_id=channel, thread_ts=thread, status="thinking"
        )
        body = {
            "model": "floor",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": event["text"]}],
        }
        await self.stream(channel, thread, body)
        await self.statements(1, thread)

    async def stream(self, channel: str, thread: str, body: dict[str, Any]) -> None:
        """The model's answer into the thread at the product's pace; the reply counts as
        streaming from its first words to its stop, as a ``ReplyStream`` does.

        Words not yet due go out when they are due, by one timer per reply armed while words
        wait (a task sends them): checking only as the next words arrive sent them up to a
        word's interval late, and so made fewer calls than the product's pacer (4.8 appends a
        turn against the product's 6.0 at N = 10)."""
        assert self.client is not None
        assert self.http is not None
        reply = _Paced(self.client, channel, self.pacer)
        try:
            async with self.http.post(
                f"{self.model_url}/chat/completions",
                json=body,
                headers={"Authorization": "Bearer sk-floor"},
            ) as response:
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or [{}]
                    text = choices[0].get("delta", {}).get("content") or ""
                    if text:
                        await reply.add(thread, text)
        finally:
            await reply.stop()

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        # The benchmark reads how many messages a replica shed; this server sheds none.
        return web.Response(text="slack_agent_messages_shed_total 0\n")


def main(started: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM; ``started`` is called on the running loop before the first
    request (``bench.load.counts`` sets its signal handler there)."""
    floor = Floor(
        os.environ["DATABASE_URL"],
        os.environ["SLACK_API_URL"],
        os.environ["OPENAI_BASE_URL"],
        os.environ["SLACK_SIGNING_SECRET"],
    )
    app = web.Application()
    app.on_startup.append(floor.open)
    if started is not None:

        async def call(app: web.Application) -> None:
            started()

        app.on_startup.append(call)
    app.on_cleanup.append(floor.close)
    app.router.add_post("/slack/events", floor.events)
    app.router.add_get("/healthz", floor.healthz)
    app.router.add_get("/metrics", floor.metrics)
    web.run_app(app, host="127.0.0.1", port=int(os.environ["PORT"]), print=None)


if __name__ == "__main__":
    main()
