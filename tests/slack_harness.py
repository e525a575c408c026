"""Running the real bot for scenario tests: in this process (``running_bot``) or as a real
``slack-agent serve`` child process (``ServeProcess``), always reached over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bot.intake import IntakeThread
from bot.service import Bot
from core.settings import load_settings
from standins.processes import child_environment, free_port, until_healthy
from standins.server import serve_app
from standins.slack import SIGNING_SECRET, SlackClient, SlackStandIn
from tests.helpers import ROOT


@dataclass
class RunningBot:
    url: str
    bot: Bot
    metrics_url: str | None = None  # METRICS_PORT's listener (``intake=True`` only)


def bot_settings(database_url: str, slack: SlackStandIn, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "database_url": database_url,
        "slack_bot_token": "xoxb-test",
        "slack_signing_secret": SIGNING_SECRET,
        "slack_api_url": slack.api_url,
        "model_provider": "offline",
        "sweeper_interval_seconds": 0,
        "busy_poll_seconds": 0.05,
        "host": "127.0.0.1",
        "port": 0,
    }
    values.update(overrides)
    return values


@contextlib.asynccontextmanager
async def running_bot(
    database_url: str, slack: SlackStandIn, *, intake: bool = False, **overrides: Any
) -> AsyncIterator[RunningBot]:
    """``intake``: Slack's requests served from the intake's own thread and loop, as ``serve``
    does (``bot.intake``); otherwise on this loop (the test's), as the demo does."""
    bot = await Bot.open(load_settings(**bot_settings(database_url, slack, **overrides)))
    bot.answers.pacer.base = 0.05
    bot.start()
    # As serve starts: Slack is asked who the token is and the database's connections are
    # opened before the listener opens, so no acknowledgement waits on them (bot.serve).
    await bot.prepare_to_listen()
    if intake:
        thread = IntakeThread(bot, "127.0.0.1", 0, events=True)
        thread.start()
        try:
            await thread.started()
            apart = thread.metrics_bound_port
            metrics_url = None if apart is None else f"http://127.0.0.1:{apart}"
            yield RunningBot(f"http://127.0.0.1:{thread.bound_port}", bot, metrics_url)
        finally:
            await thread.stop()
            await bot.close()
        return
    runner, url = await serve_app(bot.web_app())
    try:
        yield RunningBot(url, bot)
    finally:
        await runner.cleanup()
        await bot.close()


class ServeProcess:
    """``python -m bot serve`` as a child process with the given environment."""

    def __init__(
        self, database_url: str, slack: SlackStandIn, *, log: Path | None = None, **env: Any
    ) -> None:
        """``log``: its output goes to that file (read any time with ``logged``) instead of
        a pipe read at the end (a process that logs much while a test waits would fill it)."""
        self.port = free_port()
        self.log = log
        self.url = f"http://127.0.0.1:{self.port}"
        values = {
            "DATABASE_URL": database_url,
            "SLACK_BOT_TOKEN": "xoxb-test",
            "SLACK_SIGNING_SECRET": SIGNING_SECRET,
            "SLACK_API_URL": slack.api_url,
            "MODEL_PROVIDER": "offline",
            "SWEEPER_INTERVAL_SECONDS": "0",
            "BUSY_POLL_SECONDS": "0.05",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
        }
        values.update({k.upper(): str(v) for k, v in env.items()})
        sink = None if log is None else log.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bot", "serve"],
            env=child_environment(**values, PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE if log is None else subprocess.DEVNULL,
            stderr=subprocess.PIPE if sink is None else sink,
            text=True,
        )
        if sink is not None:
            sink.close()  # the child has its own

    def logged(self) -> str:
        return "" if self.log is None else self.log.read_text()

    async def ready(self, within: float = 120.0) -> None:
        """Until the health check answers. Starting is importing the whole product (seconds of
        CPU); on a shared 2-core machine running several suites that took over 30 s, failing
        tests that prove nothing about start-up time. A serve that exits fails at once."""
        failed = await until_healthy(self.url, lambda: self.proc.poll() is not None, within=within)
        if failed == "exited":
            raise AssertionError(f"serve exited: {self.output()}")
        if failed:
            raise AssertionError("serve did not become ready")

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        out, err = self.proc.communicate()
        return (out or "") + (err or "") + self.logged()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    async def wait(self, within: float = 30.0) -> int:
        return await asyncio.to_thread(self.proc.wait, within)

    async def astop(self) -> str:
        """``stop`` without blocking this event loop (fake servers in it must keep answering)."""
        return await asyncio.to_thread(self.stop)

    def stop(self) -> str:
        """SIGTERM, wait, and return what the process printed."""
        self.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        out, err = self.proc.communicate()
        return (out or "") + (err or "") + self.logged()


OAUTH = {
    "slack_bot_token": None,
    "slack_client_id": "111.222",
    "slack_client_secret": "client-secret",
}


async def oauth_install(bot_url: str) -> None:
    """Install the app into the stand-in's workspace the way a person does: /slack/install,
    then Slack's redirect back with a code (exchanged at the stand-in's oauth.v2.access)."""
    import re

    async with aiohttp.ClientSession() as http:
        async with http.get(bot_url + "/slack/install", allow_redirects=False) as r:
            assert r.status in (200, 302)
            page = await r.text() + r.headers.get("Location", "")
            cookie = r.headers["Set-Cookie"].split(";", 1)[0]  # Secure: sent by hand over http
        found = re.search(r"state=([\w-]+)", page)
        assert found is not None, page
        callback = f"{bot_url}/slack/oauth_redirect?code=the-code&state={found[1]}"
        async with http.get(callback, allow_redirects=False, headers={"Cookie": cookie}) as r:
            assert r.status in (200, 302), await r.text()


async def rewind(
    client: SlackClient, slack: SlackStandIn, *, message_ts: str, thread_ts: str, user: str = "U1"
) -> dict[str, Any]:
    """*Rewind to here* as a person does it: the shortcut, then the confirmation's submit.
    Returns the confirmation modal the app opened."""
    opened = len(slack.named("views.open"))
    assert (
        await client.shortcut(
            "rewind_session", message_ts=message_ts, thread_ts=thread_ts, user=user
        )
        == 200
    )
    await slack.wait_for(lambda: len(slack.named("views.open")) > opened)
    view: dict[str, Any] = slack.named("views.open")[-1].args["view"]
    assert await client.submit_view(view, user=user) == 200
    return view
