"""A replica's first acknowledgement pays no one-time cost: the database's connections (and
the statements its acknowledgement runs) are opened before the listener is (``Bot.warm``).

A full run under load had a fresh replica's first message answered 503 at the 2.5 s deadline:
inside that first request it opened the pools' first connections, each engine's first also
running SQLAlchemy's dialect initialisation and every one asyncpg's codec set-up, several
round trips each on a new server backend; later requests took a tenth of it. Here opening a
connection takes longer than the deadline (a proxy holds each new one), after the start:
a first message that opened any connection would be answered 503.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from bot.http import ACK_DEADLINE_SECONDS
from standins.slack import SlackClient, SlackStandIn
from standins.tcp_proxy import TcpProxy
from tests.slack_harness import running_bot


# Connections opened over a network: PostgreSQL's case (SQLite opens a file).
@pytest.mark.parametrize("backend", ["postgresql"])
async def test_first_message__acknowledged_without_opening_a_connection(
    database_url: str, slack: SlackStandIn
) -> None:
    parts = urlsplit(database_url)
    async with TcpProxy("127.0.0.1", parts.port or 5432) as proxy:
        url = urlunsplit(parts._replace(netloc=f"postgres@127.0.0.1:{proxy.port}"))
        # As serve runs: the intake's own thread, loop and engine acknowledge.
        async with running_bot(url, slack, intake=True) as bot, SlackClient(bot.url) as client:
            proxy.opening_delay = ACK_DEADLINE_SECONDS + 1
            # A follow-up in a thread nobody knows: the acknowledgement reads (a held
            # connection and a pooled one), records (an urgent one) and reads again.
            status = await client.event(
                {
                    "type": "message",
                    "user": "U1",
                    "text": "and one more thing",
                    "ts": client.new_ts(),
                    "thread_ts": client.new_ts(),
                    "channel": "C1",
                    "channel_type": "channel",
                }
            )
            assert status == 200
            proxy.opening_delay = 0  # the bot's stop may open what it needs
