"""The HTTP API's costs: a chat's first byte beside the terminal's, and idle pollers' CPU.

``slack-agent bench web-first-byte [RUNS]``: one ``serve``-shaped process here (the listener
on the intake's thread and loop, turns on this loop, as ``serve`` runs them), a model stand-in
that holds each answer before its first token until the benchmark lets it go. Each run takes
the time from letting the token go to (a) the first ``text-delta`` chunk a client of the API
reads over HTTP and (b) the first text the terminal's renderer is handed by the conversation
door for the same kind of turn (the terminal renders in its own process straight from the
door). Runs alternate; p50 and p95 of each, in milliseconds.

``slack-agent bench web-pollers [CLIENTS [SECONDS]]``: a real ``slack-agent serve`` child
(SQLite, the Slack stand-in in a process of its own) and CLIENTS (default 200) clients each
polling one idle session's ``GET /v1/agent_sessions/{id}`` every 3 s, spread evenly, over
SECONDS (default 60) after a warm-up; the child's CPU (``/proc``) as a share of one core, and
the polls' latency.

``slack-agent bench web-cpu [TURNS]``: the same child and the offline model; TURNS chats one
after another through the API on one session, then TURNS signed Slack mentions one after
another in one thread; ``serve``'s own CPU per turn for each surface (the bench reads the
database to see a Slack turn end, which costs ``serve`` nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import (
    SECRET,
    cpu_times,
    serve_process,
    standin_process,
    stop_process,
    summarize,
)
from bot.intake import IntakeThread
from bot.service import Bot
from core.conversation import Arrival, MemoryView, QuietRenderer, Said, TurnEvent
from core.settings import load_settings
from core.storage import Storage
from standins.openai import GatedModel
from standins.slack import BOT_USER, SIGNING_SECRET, TEAM, SlackStandIn, signed_headers

PERSON = "slack:T1:UBENCH"
POLL_SECONDS = 3.0


class _FirstText(QuietRenderer):
    """The terminal's view of a turn, reduced to when its first text arrives."""

    def __init__(self) -> None:
        self.first: float | None = None

    async def event(self, event: TurnEvent) -> None:
        if isinstance(event, Said) and self.first is None:
            self.first = time.perf_counter()


async def _token(storage: Storage) -> str:
    user_id = await storage.sessions.get_or_create_user(PERSON)
    _, secret = await storage.web_access.create_token(user_id, name="bench", expires_days=1)
    return secret


async def _first_byte(runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        async with SlackStandIn() as slack, GatedModel() as model:
            settings = load_settings(
                database_url=f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}",
                slack_bot_token="xoxb-bench",
                slack_signing_secret=SIGNING_SECRET,
                slack_api_url=slack.api_url,
                model_provider="openai",
                openai_api_key="sk-bench",
                openai_base_url=model.base_url,
                sweeper_interval_seconds=0,
                host="127.0.0.1",
                port=0,
                log_level="WARNING",
                web_chats_per_minute=100_000,
            )
            bot = await Bot.open(settings)
            bot.start()
            intake = IntakeThread(bot, "127.0.0.1", 0, events=True)
            intake.start()
            try:
                await intake.started()
                url = f"http://127.0.0.1:{intake.bound_port}"
                token = await _token(bot.runtime.storage)
                headers = {"Authorization": f"Bearer {token}"}
                async with aiohttp.ClientSession(headers=headers) as http:
                    made = await (await http.post(url + "/v1/agent_sessions", json={})).json()
                    path = f"{url}/v1/agent_sessions/{made['id']}"
                    api: list[float] = []
                    terminal: list[float] = []
                    for run in range(2 * runs + 2):  # the first two warm up
                        if run % 2 == 0:
                            took = await _api_run(http, path, model)
                            (api if run >= 2 else []).append(took)
                        else:
                            took = await _terminal_run(bot, made["id"], path, http, model)
                            (terminal if run >= 2 else []).append(took)
            finally:
                await intake.stop()
                await bot.close()
    return {"api": summarize(api), "terminal": summarize(terminal)}


async def _last(http: aiohttp.ClientSession, path: str) -> str | None:
    shown = await (await http.get(path)).json()
    last = shown["lastMessageId"]
    return last if isinstance(last, str) else None


async def _released(model: GatedModel) -> float:
    """Let the held answer's first token go; when."""
    await asyncio.wait_for(model.arrived.wait(), 30)
    released = time.perf_counter()
    model.gate.set()
    return released


def _hold(model: GatedModel) -> None:
    model.gate.clear()
    model.arrived.clear()


async def _api_run(http: aiohttp.ClientSession, path: str, model: GatedModel) -> float:
    _hold(model)
    last = await _last(http, path)
    first: float | None = None

    async def chat() -> None:
        nonlocal first
        async with http.post(path + "/chat", json={"message": "q", "lastMessageId": last}) as r:
            if r.status != 200:
                raise RuntimeError(f"chat answered {r.status}: {await r.text()}")
            async for line in r.content:
                if first is None and line.startswith(b"data: ") and b'"text-delta"' in line:
                    first = time.perf_counter()

    task = asyncio.create_task(chat())
    released = await _released(model)
    await task
    assert first is not None, "the answer had no text"
    return first - released


async def _terminal_run(
    bot: Bot, session_id: int, path: str, http: aiohttp.ClientSession, model: GatedModel
) -> float:
    _hold(model)
    last = await _last(http, path)
    renderer = _FirstText()
    arrival = Arrival(PERSON, "q", session_id=session_id, view=MemoryView(last))
    task = asyncio.create_task(bot.api.conversations.answer(arrival, renderer))
    released = await _released(model)
    await task
    assert renderer.first is not None, "the answer had no text"
    return renderer.first - released


async def _pollers(clients: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        standin, api_url = await standin_process()
        database = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        proc, port = await serve_process(database, api_url, tmp)
        storage = Storage.open(load_settings(database_url=database))
        try:
            token = await _token(storage)
            url = f"http://127.0.0.1:{port}"
            connector = aiohttp.TCPConnector(limit=clients + 10)
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
                made = await (await http.post(url + "/v1/agent_sessions", json={})).json()
                path = f"{url}/v1/agent_sessions/{made['id']}"
                took: list[float] = []
                measuring = asyncio.Event()
                stop = asyncio.Event()

                async def poll(offset: float) -> None:
                    await asyncio.sleep(offset)
                    while not stop.is_set():
                        started = time.perf_counter()
                        async with http.get(path) as response:
                            await response.read()
                            if response.status != 200:
                                raise RuntimeError(f"GET answered {response.status}")
                        if measuring.is_set():
                            took.append(time.perf_counter() - started)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), POLL_SECONDS)

                spread = random.Random(7)
                tasks = [
                    asyncio.create_task(poll(spread.uniform(0, POLL_SECONDS)))
                    for _ in range(clients)
                ]
                await asyncio.sleep(2 * POLL_SECONDS)  # every client polling, connections warm
                user0, sys0 = cpu_times(proc.pid)
                began = time.perf_counter()
                measuring.set()
                await asyncio.sleep(seconds)
                user1, sys1 = cpu_times(proc.pid)
                window = time.perf_counter() - began
                stop.set()
                await asyncio.gather(*tasks)
        finally:
            await storage.dispose()
            await stop_process(proc)
            await stop_process(standin)
    cpu = (user1 - user0) + (sys1 - sys0)
    return {
        "clients": clients,
        "seconds": round(window, 1),
        "polls": len(took),
        "cpu_share_of_a_core_percent": round(100 * cpu / window, 2),
        "poll_latency_ms": summarize(took),
    }


async def _cpu_per_turn(turns: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        standin, api_url = await standin_process()
        database = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        proc, port = await serve_process(database, api_url, tmp, {"WEB_CHATS_PER_MINUTE": "100000"})
        storage = Storage.open(load_settings(database_url=database))
        try:
            token = await _token(storage)
            url = f"http://127.0.0.1:{port}"
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(headers=headers) as http:
                made = await (await http.post(url + "/v1/agent_sessions", json={})).json()
                path = f"{url}/v1/agent_sessions/{made['id']}"
                last: str | None = None

                async def web_turn() -> None:
                    nonlocal last
                    sent = {"message": "benchmark message", "lastMessageId": last}
                    async with http.post(path + "/chat", json=sent) as response:
                        if response.status != 200:
                            raise RuntimeError(f"chat answered {response.status}")
                        async for line in response.content:
                            if line.startswith(b'data: {"type":"start"'):
                                last = json.loads(line[6:])["messageId"]

                api = await _cpu_of(proc.pid, turns, web_turn)
            root = f"{int(time.time())}.000100"
            count = 0

            async def slack_turn() -> None:
                nonlocal count
                ts = root if count == 0 else f"{root[:-6]}{count + 200:06d}"
                await _mention(port, ts, root if count else None)
                count += 1
                await _until_answered(storage, root, 2 * count)

            slack = await _cpu_of(proc.pid, turns, slack_turn)
        finally:
            await storage.dispose()
            await stop_process(proc)
            await stop_process(standin)
    return {"turns": turns, "api_cpu_ms_per_turn": api, "slack_cpu_ms_per_turn": slack}


async def _cpu_of(pid: int, turns: int, turn: Callable[[], Awaitable[None]]) -> float:
    await turn()  # warm: the first of each kind imports and prepares what it needs
    user0, sys0 = cpu_times(pid)
    for _ in range(turns):
        await turn()
    user1, sys1 = cpu_times(pid)
    return round(((user1 - user0) + (sys1 - sys0)) * 1000 / turns, 2)


async def _mention(port: int, ts: str, thread_ts: str | None) -> None:
    event: dict[str, Any] = {
        "type": "app_mention",
        "user": "U0BENCH",
        "text": f"<@{BOT_USER}> benchmark message",
        "ts": ts,
        "channel": "C0BENCH",
        "event_ts": ts,
        "channel_type": "channel",
    }
    if thread_ts is not None:
        event["thread_ts"] = thread_ts
    body = json.dumps(
        {
            "team_id": TEAM,
            "api_app_id": "A0BENCH",
            "type": "event_callback",
            "event_id": f"Ev{ts.replace('.', '')}",
            "event_time": int(time.time()),
            "event": event,
        }
    )
    headers = {**signed_headers(body, secret=SECRET), "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://127.0.0.1:{port}/slack/events", data=body, headers=headers) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"/slack/events answered {r.status}")


async def _until_answered(storage: Storage, root: str, messages: int) -> None:
    for _ in range(3000):
        session = await storage.sessions.find_session("slack", f"{TEAM}/C0BENCH/{root}")
        if (
            session is not None
            and not session.is_turn_active
            and len(await storage.sessions.messages(session.id)) >= messages
        ):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError("the Slack turn did not finish")


def run_part(argv: Sequence[str]) -> None:
    part, *rest = argv
    if part == "web-cpu":
        turns = int(rest[0]) if rest else 50
        print(json.dumps({"web_cpu": asyncio.run(_cpu_per_turn(turns))}))
    elif part == "web-first-byte":
        runs = int(rest[0]) if rest else 40
        print(json.dumps({"web_first_byte": asyncio.run(_first_byte(runs))}))
    else:
        clients = int(rest[0]) if rest else 200
        seconds = float(rest[1]) if len(rest) > 1 else 60.0
        print(json.dumps({"web_pollers": asyncio.run(_pollers(clients, seconds))}))
