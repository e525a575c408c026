"""The CPU one Slack Web API call costs this process: the replica's own client (slack_sdk's
``AsyncWebClient`` with the retry handlers, ``bot.slack_api``) against a bare aiohttp POST of the
same request, on one warm connection to the Slack stand-in in a process of its own.

A turn makes about nine such calls (``chat.startStream``, an ``appendStream`` for each paced
piece, ``chat.stopStream``, the agent session's status): what each costs is most of what a
turn's Slack side costs, and the bare POST is the floor under it of any client on aiohttp.
Reported: CPU per call (``time.process_time``), ``ROUNDS`` rounds of ``CALLS`` calls each,
the two alternating::

    uv run slack-agent bench slack-calls
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aiohttp

from bench.common import standin_process, stop_process
from bot.slack_api import web_client
from core.settings import Settings

CALLS: Final = 400
ROUNDS: Final = 5
TOKEN: Final = "xoxb-bench"


async def _per_call(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    """CPU milliseconds per call, over ``calls`` calls one after another."""
    started = time.process_time()
    for _ in range(calls):
        await call()
    return (time.process_time() - started) * 1000 / calls


async def bench_slack_calls(calls: int = CALLS, rounds_of: int = ROUNDS) -> dict[str, Any]:
    proc, api_url = await standin_process()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            settings = Settings(slack_api_url=api_url)
            client = web_client(settings, TOKEN, session=http)
            ts = str((await client.chat_startStream(channel="C0BENCH", thread_ts="1.000001"))["ts"])
            body = {"channel": "C0BENCH", "ts": ts, "markdown_text": "word "}
            headers = {"Authorization": f"Bearer {TOKEN}"}

            async def sdk() -> None:
                await client.chat_appendStream(channel="C0BENCH", ts=ts, markdown_text="word ")

            async def bare() -> None:
                async with http.post(
                    api_url + "chat.appendStream", json=body, headers=headers
                ) as response:
                    if not (await response.json())["ok"]:
                        raise RuntimeError("the stand-in refused chat.appendStream")

            await sdk()  # warm
            await bare()
            rounds: dict[str, list[float]] = {"slack_sdk": [], "aiohttp": []}
            for _ in range(rounds_of):
                rounds["slack_sdk"].append(await _per_call(sdk, calls))
                rounds["aiohttp"].append(await _per_call(bare, calls))
    finally:
        await stop_process(proc)
    return {
        name: {"median_ms": round(statistics.median(xs), 3), "rounds_ms": [round(x, 3) for x in xs]}
        for name, xs in rounds.items()
    }


def run_part(_argv: list[str]) -> None:
    """``slack-agent bench slack-calls``."""
    print(json.dumps(asyncio.run(bench_slack_calls())))
