"""``slack-agent serve``: migrate, ask Slack who the token is (``auth.test``) and open the
database's connections (so no acknowledgement waits for either: ``Bot.prepare_to_listen``),
then listen and run the bot until
SIGTERM/SIGINT.

HTTP mode: Slack's requests arrive on ``HOST:PORT`` (``bot.http``), served from the intake's
own thread and event loop (``bot.intake``) so turn work never delays an acknowledgement.
Socket Mode when SLACK_APP_TOKEN is set; the same HTTP listener then serves only the operator's
endpoints (``/healthz``, ``/livez``, ``/readyz``, ``/metrics``). METRICS_PORT (and
METRICS_HOST) moves them to a listener of their own. The sweeper runs in a thread with its own
event loop and engine (``core.sweeping``) unless SWEEPER_INTERVAL_SECONDS=0.

Stopping (SIGTERM/SIGINT): events stop (the socket closes; HTTP events get 503, which Slack retries
elsewhere, and ``/readyz`` answers 503 until the process exits), messages not yet in a turn are
released for the next replica at once, running turns get ``SHUTDOWN_GRACE_SECONDS`` to finish and
are then interrupted (partial answer and sandbox state kept, the thread told, the lock released),
and the process exits with 0.
A second SIGTERM/SIGINT during that stop ends the process at once (exit status 128 + the
signal's number, as a shell reports a process a signal ended): an operator's second Ctrl-C, or a
process manager that is done waiting. What that skips is what SIGKILL skips, and the next replica
takes it over after the staleness window (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from bot.gc_tuning import tune_garbage_collection
from bot.intake import IntakeThread
from bot.service import Bot
from bot.slack_api import web_client
from core.runtime import Settings, SweeperThread

log = logging.getLogger(__name__)


async def _close_socket(client: Any) -> None:
    """Close a Socket Mode connection at once. slack_sdk's ``close`` closes the WebSocket while
    its receiver task still reads from it, so the close handshake waits out aiohttp's 10 s
    timeout; stopping the background tasks first makes it immediate."""
    client.closed = True
    client.auto_reconnect_enabled = False
    for task in (client.message_processor, client.current_session_monitor, client.message_receiver):
        if task is not None:
            task.cancel()
    await client.disconnect()
    if client.aiohttp_client_session is not None:
        await client.aiohttp_client_session.close()


def _force_exit(sig: signal.Signals) -> None:
    """The second signal: one line, then out without waiting for anything (not even the
    handlers' own flush, hence the explicit one)."""
    log.warning("%s again while stopping: exiting now, without waiting for running turns", sig.name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(128 + sig.value)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT, then stop cleanly (see the module's docstring)."""
    warning = settings.database_timeout_warning()
    if warning:  # once, where the window matters: never on every command (core.storage)
        log.warning("%s", warning)
    bot = await Bot.open(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            _force_exit(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    sweeper: SweeperThread | None = None
    intake: IntakeThread | None = None
    socket: Any = None
    try:
        # Before anything is leased or acknowledged: the full collection stops the whole
        # process (every thread: the intake too), for over a second on a loaded machine, and
        # after the listener was up it stopped a replica already holding messages.
        tune_garbage_collection()
        # Before the listener opens: Bolt would otherwise ask Slack who the token is inside
        # the first acknowledgement (``Bot.ask_who_it_is``), and the first message would open
        # the database's connections inside it (``Bot.warm``).
        await bot.prepare_to_listen()
        socket_mode = bool(settings.slack_app_token)
        bot.start()  # before the intake: it hands records to the running worker
        intake = IntakeThread(bot, settings.host, settings.port, events=not socket_mode)
        intake.start()
        await intake.started()
        if settings.sweeper_interval_seconds > 0:
            sweeper = SweeperThread(settings)
            sweeper.start()
        if socket_mode:
            from slack_bolt.adapter.socket_mode.aiohttp import AsyncSocketModeHandler

            socket = AsyncSocketModeHandler(
                bot.app,
                settings.slack_app_token,
                web_client=web_client(settings, settings.slack_bot_token),
            )
            await socket.connect_async()
            log.info("connected to Slack in Socket Mode")
        else:
            log.info("listening on http://%s:%d/slack/events", settings.host, settings.port)
        if settings.metrics_port is not None:
            operator = (settings.metrics_host or settings.host, settings.metrics_port)
        else:
            operator = (settings.host, settings.port)
        log.info("/healthz, /livez, /readyz and /metrics on http://%s:%d", *operator)
        await stop.wait()
        log.info(
            "stopping: no new events; waiting messages go back to the database; running turns "
            "get %gs to finish",
            settings.shutdown_grace_seconds,
        )
    finally:
        if socket is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(_close_socket(socket.client), 5)
        # The listener outlives the drain: while running turns finish, Slack's requests get
        # 503 (sent again to another replica), /readyz says "stopping" and /livez still
        # answers, so neither an orchestrator nor a load balancer takes the drain for a crash.
        # Requests still being handled on the intake end first (a record in flight after its
        # 503 included), so none hands a record to the stopped worker or writes after it.
        grace = settings.shutdown_grace_seconds
        until = loop.time() + grace
        bot.stop_taking()
        if intake is not None:
            await intake.settle(grace)
        await bot.close(max(0.0, until - loop.time()))  # one grace period for both
        if intake is not None:
            await intake.stop()
        if sweeper is not None:
            sweeper.stop()
            await asyncio.to_thread(sweeper.join, 10)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("stopped")
