"""``slack-agent serve``: migrate, then run the bot until SIGTERM/SIGINT.

HTTP mode: an aiohttp server on HOST:PORT with ``POST /slack/events`` (Bolt verifies the
signature and the 5-minute timestamp window: 401 otherwise), and, with OAuth configured,
``/slack/install`` and ``/slack/oauth_redirect``. Bodies over ``MAX_BODY_BYTES`` get 413,
undecodable ones 400; neither disturbs the process. Socket Mode when SLACK_APP_TOKEN is set; the
same HTTP listener then serves only the operator's endpoints. In both modes ``GET /healthz``
answers 200 while the database answers (503 otherwise) and ``GET /metrics`` serves Prometheus
metrics. The sweeper runs in a thread with its own event loop and engine unless
SWEEPER_INTERVAL_SECONDS=0.

Stopping (SIGTERM/SIGINT): events stop (the socket closes; HTTP events get 503, which Slack
retries elsewhere), messages not yet in a turn are released for the next replica at once,
running turns get ``SHUTDOWN_GRACE_SECONDS`` to finish and are then interrupted (partial answer
and sandbox state kept, the thread told, the lock released), and the process exits with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import signal
import threading
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response
from slack_bolt.async_app import AsyncApp
from slack_bolt.oauth.async_oauth_settings import AsyncOAuthSettings
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient

from bot.app import build_app
from bot.conversations import SURFACE, Conversations
from bot.installations import InstallStores, open_install_stores
from bot.session_actions import SessionActions
from bot.web import http_session, web_client
from bot.worker import DeliveryWorker
from core import metrics
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.errors import ConfigError, DatabaseError
from core.settings import Settings
from core.storage.deliveries import Deliveries
from core.storage.engine import Database, create_database
from core.storage.migrate import upgrade
from core.storage.retention import RetentionPolicy, load_policy
from core.storage.sessions import SessionStore
from core.storage.surface_state import SURFACE_SWEEPS, SurfaceState
from core.storage.sweeper import sweep

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # Slack's payloads are a few kilobytes


def check_config(settings: Settings) -> None:
    """One line naming the variable a mode needs (never a traceback)."""
    oauth = [settings.slack_client_id, settings.slack_client_secret, settings.slack_state_secret]
    if any(oauth) and not all(oauth):
        missing = ("SLACK_CLIENT_ID", "SLACK_CLIENT_SECRET", "SLACK_STATE_SECRET")[
            [bool(v) for v in oauth].index(False)
        ]
        raise ConfigError(f"{missing}: required with the other SLACK_CLIENT_* OAuth settings")
    if settings.slack_app_token:
        if not settings.slack_app_token.startswith("xapp-"):
            raise ConfigError("SLACK_APP_TOKEN: an app-level token starts with xapp-")
        if not settings.slack_bot_token:
            raise ConfigError("SLACK_BOT_TOKEN: required in Socket Mode (SLACK_APP_TOKEN is set)")
        return
    if not settings.slack_signing_secret:
        raise ConfigError("SLACK_SIGNING_SECRET: required to verify Slack's HTTP requests")
    if not settings.slack_bot_token and not all(oauth):
        raise ConfigError(
            "SLACK_BOT_TOKEN: required (or SLACK_CLIENT_ID/SECRET/STATE_SECRET for OAuth installs)"
        )


class SweeperThread(threading.Thread):
    """The sweeper on its own loop and engine, every interval ± jitter, on every replica."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(name="sweeper", daemon=True)
        self.settings = settings
        self._stopping = threading.Event()  # not ``_stop``: Thread.join calls a method of that name

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        s = self.settings
        db = create_database(s.database_url, pool_size=2)
        try:
            while True:
                jitter = random.uniform(-s.sweeper_jitter_seconds, s.sweeper_jitter_seconds)
                delay = max(0.05, s.sweeper_interval_seconds + jitter)
                if await asyncio.to_thread(self._stopping.wait, delay):
                    return
                try:
                    policy = await load_policy(db, RetentionPolicy.from_settings(s))
                    report = await sweep(
                        db,
                        policy,
                        staleness_seconds=s.turn_lock_staleness_seconds,
                        batch_size=s.sweeper_batch_size,
                        extra_passes=SURFACE_SWEEPS,
                    )
                except Exception:
                    log.exception("sweeper pass failed; will try again next period")
                    continue
                log.info(
                    "sweeper: deleted %d expired, %d idle, %d over-cap sessions; "
                    "%d snapshot contents; %d finished delivery records",
                    report.expired,
                    report.idle,
                    report.over_cap,
                    report.snapshot_contents,
                    report.extra.get("deliveries", 0),
                )
        finally:
            await db.dispose()


class Bot:
    """Everything ``serve`` runs, built from settings (tests and the demo build one too)."""

    def __init__(
        self,
        settings: Settings,
        db: Database,
        installs: InstallStores | None,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.http = http  # the Web API's session (kept open: warm connections); ours to close
        self.installs = installs
        self.store = SessionStore(
            db,
            staleness_seconds=settings.turn_lock_staleness_seconds,
            temporary_ttl_hours=settings.temporary_agent_session_time_to_live_hours,
        )
        self.providers = ProviderCache(settings)
        self.agent = Agent(
            self.store,
            self.providers,
            AgentConfig(
                auto_compact_tokens=settings.auto_compact_tokens,
                heartbeat_seconds=settings.turn_heartbeat_seconds,
            ),
        )
        self.conversations = Conversations(
            settings, self.store, self.agent, SurfaceState(db, SURFACE)
        )
        self.deliveries = Deliveries(
            db, SURFACE, staleness_seconds=settings.turn_lock_staleness_seconds
        )
        metrics.REPLICA.info({"owner": self.deliveries.owner})
        self.worker = DeliveryWorker(
            settings,
            self.deliveries,
            self.conversations,
            self.client_for,
            max_turns=settings.max_concurrent_turns,
        )
        self.actions = SessionActions(self.conversations)
        oauth: AsyncOAuthSettings | None = None
        if installs is not None:
            oauth = AsyncOAuthSettings(
                client_id=settings.slack_client_id,
                client_secret=settings.slack_client_secret,
                scopes=BOT_SCOPES,
                installation_store=installs.installations,
                state_store=installs.states,
                install_path="/slack/install",
                redirect_uri_path="/slack/oauth_redirect",
            )
        # HTTP mode only (check_config requires the secret there; Socket Mode has no signature).
        self._verifier = (
            SignatureVerifier(settings.slack_signing_secret)
            if settings.slack_signing_secret
            else None
        )
        self.app: AsyncApp = build_app(
            settings,
            self.conversations,
            self.worker,
            self.actions,
            oauth_settings=oauth,
            http_session=http,
        )

    @classmethod
    async def open(cls, settings: Settings) -> Bot:
        check_config(settings)
        db = create_database(
            settings.database_url, synchronous_commit=settings.postgres_synchronous_commit
        )
        try:
            await upgrade(db)
            installs = None
            if settings.slack_client_id and settings.slack_client_secret:
                installs = await open_install_stores(
                    settings.database_url, settings.slack_client_id
                )
        except BaseException:
            await db.dispose()
            raise
        return cls(settings, db, installs, http_session())

    def start(self) -> None:
        """Begin renewing leases and taking over what stopped or dead replicas left."""
        self.worker.start()

    async def close(self) -> None:
        """Stop cleanly: see the module's docstring."""
        grace = self.settings.shutdown_grace_seconds
        self.conversations.closing = True
        await asyncio.gather(self.worker.stop(grace), self.conversations.shutdown(grace))
        await self.providers.aclose()
        if self.installs is not None:
            await self.installs.dispose()
        await self.db.dispose()
        if self.http is not None:
            await self.http.close()

    async def client_for(self, team: str) -> AsyncWebClient | None:
        """A Web API client for a workspace (for records taken over outside any request)."""
        if self.installs is None:
            return self.app.client
        bot = await self.installs.installations.async_find_bot(enterprise_id=None, team_id=team)
        if bot is None or not bot.bot_token:
            return None
        return web_client(self.settings, bot.bot_token, self.http)

    # -- HTTP -----------------------------------------------------------------------------------

    def web_app(self, *, events: bool = True) -> web.Application:
        """The HTTP listener: Slack's requests (``events``, HTTP mode) and the operator's."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/healthz", self._health)
        app.router.add_get("/metrics", self._metrics)
        if events:
            app.router.add_post("/slack/events", self._events)
            if self.installs is not None:
                app.router.add_get("/slack/install", self._install)
                app.router.add_get("/slack/oauth_redirect", self._oauth_redirect)
        return app

    async def _install(self, request: web.Request) -> web.StreamResponse:
        flow = self.app.oauth_flow
        assert flow is not None
        response = await flow.handle_installation(self._get_request(request))
        return await to_aiohttp_response(response)

    async def _oauth_redirect(self, request: web.Request) -> web.StreamResponse:
        flow = self.app.oauth_flow
        assert flow is not None
        response = await flow.handle_callback(self._get_request(request))
        return await to_aiohttp_response(response)

    @staticmethod
    def _get_request(request: web.Request) -> AsyncBoltRequest:
        headers: dict[str, str | Sequence[str]] = {k.lower(): v for k, v in request.headers.items()}
        return AsyncBoltRequest(body="", query=request.query_string, headers=headers)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Bolt's dispatch, in the request: a message is recorded before the 200 goes out.

        The signature is checked here, before anything is parsed: Bolt parses a body before it
        verifies it and fails on JSON that is not an object, so an unsigned request must never
        get that far. Whatever a signed body holds, a malformed one is a 400, never a 5xx.
        """
        if self.worker.closing:
            return web.Response(status=503, text="shutting down")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(status=413, text="request body too large")
        headers: dict[str, str | Sequence[str]] = {k.lower(): v for k, v in request.headers.items()}
        try:
            body = raw.decode("utf-8")
        except UnicodeDecodeError:
            return web.Response(status=400, text="request body is not UTF-8")
        if not self._signed(body, request):
            return web.Response(status=401, text="invalid or stale signature")
        try:
            bolt_request = AsyncBoltRequest(body=body, query=request.query_string, headers=headers)
        except Exception:
            return web.Response(status=400, text="malformed request body")
        try:
            with self.worker.arriving():
                response = await self.app.async_dispatch(bolt_request)
        except Exception:
            log.warning("malformed request: dispatch failed", exc_info=True)
            return web.Response(status=400, text="malformed request")
        return await to_aiohttp_response(response)

    def _signed(self, body: str, request: web.Request) -> bool:
        """Slack's v0 signature over the body, within its 5-minute timestamp window."""
        if self._verifier is None:
            return False
        timestamp = request.headers.get("X-Slack-Request-Timestamp", "")
        signature = request.headers.get("X-Slack-Signature", "")
        try:
            return self._verifier.is_valid(body, timestamp, signature)
        except (ValueError, TypeError):
            return False

    async def _health(self, _request: web.Request) -> web.Response:
        if await self.db.answers():
            return web.Response(text="ok")
        return web.Response(status=503, text="database unavailable")

    async def _metrics(self, _request: web.Request) -> web.Response:
        """Prometheus text; the delivery gauges are read from the database now (if it answers:
        counters are served either way)."""
        try:
            counts = await self.deliveries.counts()
        except DatabaseError:
            log.warning("/metrics: the database did not answer; delivery gauges not updated")
        else:
            metrics.DELIVERIES.clear()
            metrics.DELIVERY_AGE.clear()
            oldest: dict[str, float] = {}
            for c in counts:
                metrics.DELIVERIES.labels(c.state, c.wait_reason or "").set(c.count)
                oldest[c.state] = max(oldest.get(c.state, 0.0), c.oldest_age_seconds)
            for state, age in oldest.items():
                metrics.DELIVERY_AGE.labels(state).set(age)
            metrics.WAITING_MESSAGES.set(sum(c.count for c in counts if c.state == "waiting"))
        body, content_type = metrics.exposition()
        response = web.Response(body=body)
        response.content_type = content_type.split(";")[0]
        response.charset = "utf-8"
        return response


BOT_SCOPES = [
    "app_mentions:read",
    "assistant:write",
    "channels:history",
    "chat:write",
    "commands",
    "files:read",
    "groups:history",
    "im:history",
    "mpim:history",
]


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


async def _listen(bot: Bot, settings: Settings, *, events: bool) -> web.AppRunner:
    runner = web.AppRunner(bot.web_app(events=events), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            f"PORT: cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
        ) from None
    return runner


# Collections of the middle generation between two full collections (CPython's default: 10).
FULL_COLLECTION_AFTER = 100


def tune_garbage_collection() -> None:
    """Keep full garbage collections out of the way of acknowledgements.

    A full collection walks every tracked object with the event loop stopped. Measured in the
    500-turn benchmark (docs/benchmarks.md) on a slow hour of the machine: with CPython's
    defaults three to six full collections ran while the turns started, of 60-235 ms each, and an
    acknowledgement that met one waited that long (PostgreSQL p99 256-375 ms in five runs of
    seven). Two changes, both kept:

    - what start-up made (modules, the app, engines, clients: about 130,000 objects, all alive
      as long as the process) is frozen out of every later collection, which made each full
      collection about half as long;
    - a full collection comes after 100 collections of the middle generation instead of 10,
      so a replica taking on hundreds of turns (175,000 tracked objects at 500) is not walked
      again at every quarter of growth: none ran while the turns started (p99 6-42 ms in ten
      runs on both databases). Garbage in cycles waits longer for its collection: the turns'
      own, about 70 objects a turn, is collected when a full collection comes.
    """
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)


async def serve(settings: Settings) -> None:
    """Run until SIGTERM/SIGINT, then stop cleanly (see the module's docstring)."""
    bot = await Bot.open(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sweeper: SweeperThread | None = None
    runner: web.AppRunner | None = None
    socket: Any = None
    try:
        socket_mode = bool(settings.slack_app_token)
        runner = await _listen(bot, settings, events=not socket_mode)
        bot.start()
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
            log.info(
                "connected to Slack in Socket Mode; /healthz and /metrics on http://%s:%d",
                settings.host,
                settings.port,
            )
        else:
            log.info("listening on http://%s:%d/slack/events", settings.host, settings.port)
        tune_garbage_collection()
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
        if runner is not None:
            await runner.cleanup()
        await bot.close()
        if sweeper is not None:
            sweeper.stop()
            await asyncio.to_thread(sweeper.join, 10)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("stopped")
