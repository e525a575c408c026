"""A bot's close ends the requests it is still handling before it disposes of its database.

A request answered 503 at the acknowledgement deadline goes on recording its message
(``bot.http``: shielded, so a record written late is carried on like any other). A full run
had such a record still opening its connection when the test ended and the bot closed: the
connection was left open behind the disposed engine (a ResourceWarning that failed the next
test on that worker). ``Bot.close`` now lets such requests end within the grace period and
cancels the rest, with the write they waited for (``DeliveryWorker.stop``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from urllib.parse import urlsplit

import asyncpg
import pytest

from standins.slack import BOT_USER, SlackClient, SlackStandIn
from tests.slack_harness import running_bot

# The coroutines of a request's handling and of the record's write (``bot.http.Listener``,
# ``core.storage.deliveries``): none may still run once the bot closed.
RECORDING = {"Listener._dispatch", "_GroupCommit._write"}


class WritesHeld:
    """Nobody can record a message until ``release``: PostgreSQL's ``deliveries`` locked
    against writes by another session, SQLite's write lock held by another connection."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self._sqlite: sqlite3.Connection | None = None
        self._pg: asyncpg.Connection | None = None

    async def take(self) -> None:
        if self.url.startswith("sqlite"):
            self._sqlite = sqlite3.connect(urlsplit(self.url).path, timeout=5)
            self._sqlite.execute("BEGIN IMMEDIATE")
            return
        self._pg = await asyncpg.connect(_dsn(self.url), timeout=10)
        await self._pg.execute("BEGIN; LOCK TABLE deliveries IN SHARE MODE")

    async def release(self) -> None:
        if self._sqlite is not None:
            self._sqlite.rollback()
            self._sqlite.close()
        if self._pg is not None:
            await self._pg.close()  # its transaction rolled back


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def others_connected(database_url: str) -> int:
    """PostgreSQL sessions on the test's database besides the one asking."""
    conn = await asyncpg.connect(_dsn(database_url), timeout=10)
    try:
        found = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(found)
    finally:
        await conn.close()


def still_recording() -> list[asyncio.Task[object]]:
    return [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__qualname__", "") in RECORDING
    ]


async def test_close__a_record_still_being_written_after_its_503_is_ended_first(
    database_url: str, slack: SlackStandIn
) -> None:
    await closed_while_recording(database_url, slack, intake=False)


# The intake's tasks are its own loop's: what it left open shows in the database's sessions.
@pytest.mark.parametrize("backend", ["postgresql"])
async def test_close__on_the_intake_thread_too(database_url: str, slack: SlackStandIn) -> None:
    """As serve runs: the record written on the intake's own thread and engine."""
    await closed_while_recording(database_url, slack, intake=True)


async def closed_while_recording(database_url: str, slack: SlackStandIn, *, intake: bool) -> None:
    """A message whose record cannot be written (another session holds the writes) is
    answered 503 at the deadline; the bot closes while it still tries. Once closed, nothing of
    it runs and no connection of the bot is left (PostgreSQL: the held lock's session alone)."""
    held = WritesHeld(database_url)
    try:
        async with (
            running_bot(database_url, slack, intake=intake, shutdown_grace_seconds=0.5) as bot,
            SlackClient(bot.url) as client,
        ):
            await held.take()
            status = await client.event(
                {
                    "type": "app_mention",
                    "user": "U1",
                    "text": f"<@{BOT_USER}> hello",
                    "ts": client.new_ts(),
                    "channel": "C1",
                    "channel_type": "channel",
                }
            )
            assert status == 503  # not recorded within the deadline: still trying
            assert intake or still_recording()
        # The bot closed while its record waited for the database (the writes still held).
        assert still_recording() == []
        if database_url.startswith("postgresql"):
            assert await others_connected(database_url) == 1  # this test's lock alone
    finally:
        await held.release()
