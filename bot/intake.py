"""Slack's HTTP requests on a thread and event loop of their own: acknowledgements that turn work
cannot delay.

A replica's turns share one event loop: rendering, streaming calls to Slack, JSON, their
bookkeeping. An acknowledgement handled on that loop waits for every ready step of every turn
ahead of it, and on a saturated replica those passes add up to seconds (docs/reliability.md:
what the soak's profile found). So ``serve`` listens on ``HOST:PORT`` from this thread instead:

- a message for the agent is verified, parsed, recorded (``core.conversation.intake``, on the
  intake's own database engine, as the same owner as the replica's delivery worker) and
  answered here; the record is then handed to the worker's loop, which carries it on as if it
  had recorded it itself. What the intake recorded is acknowledged only once it is committed,
  as before; a replica that dies after that leaves a record any replica takes over;
- a saturated replica (``MAX_HELD_MESSAGES`` records held) records the message unowned, for
  whichever replica has room, and says so in its log (``slack_agent_messages_shed_total``);
- every other request (clicks, shortcuts, ``/compact``, other events, OAuth) is dispatched on
  the turns' loop, where the full Bolt app and its clients live (``bot.http.Elsewhere``);
- ``/healthz`` and ``/metrics`` are answered here, from the intake's own engine (on
  ``METRICS_HOST:METRICS_PORT`` when that is set, a listener of their own; in Socket Mode that
  is then the only one).

Python's GIL is shared, so a turn holding it delays the intake by at most the interpreter's
switch interval per step, not by the loop's whole pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading

from aiohttp import web
from slack_bolt.async_app import AsyncApp
from slack_bolt.oauth.async_oauth_settings import AsyncOAuthSettings
from slack_sdk.web.async_client import AsyncWebClient

from bot.app import add_message_listeners, bolt_app, knows_who_it_is
from bot.http import Elsewhere, Listener, listen
from bot.installations import open_install_stores
from bot.post import SURFACE
from bot.service import Bot, oauth_settings, warm
from bot.slack_api import http_session
from core.conversation.intake import Incoming, Intake
from core.runtime import Storage

log = logging.getLogger(__name__)

# The intake's own connections: records are written on the urgent pool (``core.storage``), the
# reads of a message's thread on these.
INTAKE_POOL_SIZE = 4
STOP_SECONDS = 10.0
# At its stop, requests the intake is still handling end within this, or are cancelled (well
# inside STOP_SECONDS, which the thread's join waits).
SETTLE_SECONDS = 5.0


class _Receiver:
    """The message listener's ``Receiver`` on the intake: Bolt's client stays here (the
    worker finds its own for the record's workspace)."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def known_thread(self, thread: str) -> bool:
        return await self.intake.known_thread(thread)

    async def receive(self, message: Incoming, client: AsyncWebClient) -> None:
        await self.intake.receive(message)


class IntakeThread(threading.Thread):
    """``HOST:PORT`` served from a thread of its own (see the module's docstring).

    ``start`` then ``await started()`` (the port is listened on, or the error that stopped
    it); ``await stop()`` closes the listener and everything the thread opened.
    """

    def __init__(self, bot: Bot, host: str, port: int, *, events: bool) -> None:
        super().__init__(name="intake", daemon=True)
        self.bot = bot
        self.host = host
        self.port = port
        self.events = events
        self.turns_loop = asyncio.get_running_loop()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._listener: Listener | None = None  # once built, on the intake's loop
        self.bound_port: int | None = None  # the port listened on (``port`` 0: any free one)
        self.metrics_bound_port: int | None = None  # METRICS_PORT's, when it is set

    async def started(self) -> None:
        await asyncio.wrap_future(self._ready)

    async def settle(self, within: float) -> None:
        """The requests the intake is still handling end within ``within`` seconds or are
        cancelled (``Listener.settle``), from the turns' loop: ``serve`` calls it once requests
        are refused, before the bot closes, so no record still being written here is handed
        over to a worker that stopped."""
        loop, listener = self._loop, self._listener
        if loop is None or listener is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # its loop ended meanwhile
            done = asyncio.run_coroutine_threadsafe(listener.settle(within), loop)
            await asyncio.wrap_future(done)

    async def stop(self) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # its loop ended meanwhile
                loop.call_soon_threadsafe(stopping.set)
        await asyncio.to_thread(self.join, STOP_SECONDS)
        # Records the intake handed over just before it stopped are scheduled on this loop:
        # let them be taken (a stopping worker releases them for the next replica).
        await asyncio.sleep(0)

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # handed to the thread that waits
            if not self._ready.done():
                self._ready.set_exception(exc)
            else:
                log.exception("the intake thread failed")

    async def _main(self) -> None:
        bot, settings = self.bot, self.bot.settings
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        storage = Storage.open(settings, pool_size=INTAKE_POOL_SIZE)
        worker = bot.worker
        intake = Intake.apart(
            storage,
            SURFACE,
            owner=bot.deliveries.owner,
            hand_off=worker.hand_over,
            closing=lambda: worker.closing,
            has_room=worker.has_room,
        )
        deliveries = intake.deliveries
        installs = None
        http = http_session()
        runners: list[web.AppRunner] = []
        try:
            # Before the listener opens, as for the turns' loop (``bot.service.warm``): this
            # engine's connections are the ones its first acknowledgement uses.
            await warm(storage, intake)
            oauth: AsyncOAuthSettings | None = None
            if bot.installs is not None:
                installs = await open_install_stores(storage, settings.slack_client_id or "")
                oauth = oauth_settings(settings, installs)
            app: AsyncApp = bolt_app(settings, oauth_settings=oauth, http_session=http)
            if bot.identity is not None:  # serve asked at start: no request asks Slack first
                knows_who_it_is(app, bot.identity)
            add_message_listeners(app, _Receiver(intake))
            listener = Listener(
                settings,
                app,
                worker,
                storage,
                deliveries,
                oauth=bot.installs is not None,
                elsewhere=Elsewhere(self.turns_loop, bot.app, worker),
                api=bot.api,
            )
            self._listener = listener
            apart = settings.metrics_port is not None
            # PORT: Slack's requests (HTTP mode), the HTTP API, and the operator's endpoints
            # unless they have a listener of their own.
            runner = await listen(
                listener, self.host, self.port, events=self.events, operator=not apart
            )
            runners.append(runner)
            self.bound_port = int(runner.addresses[0][1])
            if settings.metrics_port is not None:
                host = settings.metrics_host or self.host
                runner = await listen(
                    listener,
                    host,
                    settings.metrics_port,
                    events=False,
                    api=False,
                    name="METRICS_PORT",
                )
                runners.append(runner)
                self.metrics_bound_port = int(runner.addresses[0][1])
            self._ready.set_result(None)
            await self._stopping.wait()
        finally:
            for runner in runners:
                await runner.cleanup()
            if self._listener is not None:  # before its storage goes (``Listener.settle``)
                await self._listener.settle(SETTLE_SECONDS)
            await http.close()
            if installs is not None:
                await installs.dispose()
            await storage.dispose()
