"""The HTTP listener on ``HOST:PORT``: Slack's requests (HTTP mode) and the operator's.

``serve`` runs it on the intake's own thread and event loop (``bot.intake``): a message is
recorded there, with the intake's own database engine, and handed to the turns' loop, so its
acknowledgement never waits behind turn work; every other request (clicks, shortcuts,
commands, other events, OAuth) is dispatched on the turns' loop (``Elsewhere``). Tests and the
demo may run it on the turns' loop itself (no ``Elsewhere``).

``POST /slack/events`` (Bolt verifies nothing here: the signature and the 5-minute timestamp
window are checked before anything is parsed, 401 otherwise), and, with OAuth configured,
``/slack/install`` and ``/slack/oauth_redirect``. Bodies over ``MAX_BODY_BYTES`` get 413,
undecodable ones 400; neither disturbs the process. In both modes ``GET /healthz`` answers 200
while the database answers (503 otherwise), ``GET /livez`` while the process's loops answer
(never asking the database), ``GET /readyz`` while the process is not stopping, the database
answers and its schema is this build's, and ``GET /metrics`` serves Prometheus metrics; with
METRICS_PORT set these are served on a listener of their own instead, so the public listener
carries Slack's requests only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response
from slack_bolt.async_app import AsyncApp
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient

from core.conversation.worker import DeliveryWorker, finish_or_cancel
from core.errors import ConfigError, DatabaseError
from core.runtime import Deliveries, Settings, Storage, metrics
from web.api import WebApi
from web.loops import TurnsLoop
from web.page import add_page_routes

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BODY_BYTES = 1 << 20  # Slack's payloads are a few kilobytes
# The delivery gauges of ``/metrics`` are read from the database at most this often, however
# often and by however many scrapers it is read: a scrape never costs a query of its own.
METRICS_REFRESH_SECONDS = 5.0
# Slack counts a request not answered within 3 s as failed and sends it again. Past this, the
# request is answered 503 at once (Slack sends it again, maybe to another replica) while its
# handling goes on: a replica whose database hangs (a partition, a failover) would otherwise
# hold each request until its database timeout, tens of seconds in production.
ACK_DEADLINE_SECONDS = 2.5
# The log line saying requests were answered late, at most this often.
LATE_LOG_SECONDS = 5.0
# ``/livez``: the turns' loop must run a no-op within this. A saturated loop takes passes of
# a second or more (docs/reliability.md), a wedged one never answers; the orchestrator's probe
# timeout must exceed it (the chart's does).
LOOP_ANSWER_SECONDS = 5.0
# Events recorded by the intake's own app (a message for the agent, or Slack checking the URL);
# everything else is the full app's, on the turns' loop.
INTAKE_EVENTS = frozenset({"message", "app_mention"})


@dataclass(frozen=True)
class Elsewhere:
    """The turns' loop, its full Bolt app and its delivery worker, reached from the intake."""

    loop: asyncio.AbstractEventLoop
    app: AsyncApp
    worker: DeliveryWorker[AsyncWebClient]

    async def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """``make()`` awaited on the turns' loop, its result here."""
        return await TurnsLoop(self.loop).run(make)


def for_the_intake(body: Any) -> bool:
    """A payload the intake's own app answers: a message event (recorded, then handed over)
    or Slack's URL check."""
    if not isinstance(body, dict):
        return False
    if body.get("type") == "url_verification":
        return True
    event = body.get("event")
    kind = event.get("type") if isinstance(event, dict) else None
    # Only a string can name an event (a signed payload may carry any JSON there).
    return body.get("type") == "event_callback" and isinstance(kind, str) and kind in INTAKE_EVENTS


class Listener:
    """The routes, over a Bolt app and the process's delivery worker.

    ``elsewhere``: set when this runs on the intake's loop; ``app`` is then the intake's app
    (messages only), and the rest is dispatched on the turns' loop. ``storage`` and
    ``deliveries`` are this loop's (``/healthz``, ``/metrics``).
    """

    def __init__(
        self,
        settings: Settings,
        app: AsyncApp,
        worker: DeliveryWorker[AsyncWebClient],
        storage: Storage,
        deliveries: Deliveries,
        *,
        oauth: bool,
        elsewhere: Elsewhere | None = None,
        api: WebApi | None = None,
    ) -> None:
        self.app = app
        self.api = api
        self.worker = worker
        self.storage = storage
        self.deliveries = deliveries
        self.oauth = oauth
        self.elsewhere = elsewhere
        # Requests being handled (``_handle``'s dispatches), including those answered 503 at
        # the deadline and still recording: ``settle`` ends them before the storage goes.
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._counted_at: float | None = None  # when the delivery gauges were last read
        self._counting = asyncio.Lock()  # concurrent scrapes: one reads, the others wait
        self._late_count = 0  # requests answered late since the last log line
        self._late_logged = -LATE_LOG_SECONDS
        # HTTP mode only (check_config requires the secret there; Socket Mode has no signature).
        self._verifier = (
            SignatureVerifier(settings.slack_signing_secret)
            if settings.slack_signing_secret
            else None
        )

    def web_app(
        self, *, events: bool = True, operator: bool = True, api: bool = True
    ) -> web.Application:
        """Slack's requests (``events``, HTTP mode), the operator's endpoints (``operator``;
        off when they have a listener of their own) and the HTTP API (``api``, when the
        listener has one: off on the metrics listener)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        if operator:
            app.router.add_get("/healthz", self._health)
            app.router.add_get("/livez", self._live)
            app.router.add_get("/readyz", self._ready)
            app.router.add_get("/metrics", self._metrics)
        if events:
            app.router.add_post("/slack/events", self._events)
            if self.oauth:
                app.router.add_get("/slack/install", self._install)
                app.router.add_get("/slack/oauth_redirect", self._oauth_redirect)
        if api and self.api is not None:  # the HTTP API (web.api), on the public listener
            self.api.add_routes(app)
            add_page_routes(app)  # the web page (web.page), the API's first client
        return app

    @property
    def _full_app(self) -> AsyncApp:
        return self.app if self.elsewhere is None else self.elsewhere.app

    async def _on_turns_loop(self, make: Callable[[], Awaitable[T]]) -> T:
        return await (make() if self.elsewhere is None else self.elsewhere.run(make))

    async def _install(self, request: web.Request) -> web.StreamResponse:
        flow = self._full_app.oauth_flow
        assert flow is not None
        bolt_request = self._get_request(request)
        response = await self._on_turns_loop(lambda: flow.handle_installation(bolt_request))
        return await to_aiohttp_response(response)

    async def _oauth_redirect(self, request: web.Request) -> web.StreamResponse:
        flow = self._full_app.oauth_flow
        assert flow is not None
        bolt_request = self._get_request(request)
        response = await self._on_turns_loop(lambda: flow.handle_callback(bolt_request))
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
        begun = time.perf_counter()
        metrics.INTAKE_REQUESTS.inc()
        kind = "other"
        try:
            response, kind = await self._handle(request)
            return response
        finally:
            metrics.INTAKE_REQUESTS.dec()
            metrics.ACK_SECONDS.labels(kind).observe(time.perf_counter() - begun)

    async def _handle(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        if self.worker.closing:
            return web.Response(status=503, text="shutting down"), "other"
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(status=413, text="request body too large"), "other"
        headers: dict[str, str | Sequence[str]] = {k.lower(): v for k, v in request.headers.items()}
        try:
            body = raw.decode("utf-8")
        except UnicodeDecodeError:
            return web.Response(status=400, text="request body is not UTF-8"), "other"
        if not self._signed(body, request):
            return web.Response(status=401, text="invalid or stale signature"), "other"
        try:
            bolt_request = AsyncBoltRequest(body=body, query=request.query_string, headers=headers)
        except Exception:
            return web.Response(status=400, text="malformed request body"), "other"
        intake = for_the_intake(bolt_request.body)
        kind = "message" if intake else "other"
        # Shielded: past the deadline the request is answered, not abandoned halfway. What it
        # records is idempotent by event (Slack's retry finds it recorded), and a record
        # written after the 503 is carried on as any other.
        dispatch = asyncio.create_task(self._dispatch(bolt_request, intake=intake))
        self._in_flight.add(dispatch)
        dispatch.add_done_callback(self._in_flight.discard)
        try:
            response = await asyncio.wait_for(asyncio.shield(dispatch), ACK_DEADLINE_SECONDS)
        except TimeoutError:
            self._late(dispatch, kind)
            return web.Response(status=503, text="not recorded in time; send it again"), kind
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not dispatch.cancelled() or (task is not None and task.cancelling()):
                raise  # this request's own handling was cancelled (its client went away)
            # ``settle`` cancelled its handling: the process is stopping.
            return web.Response(status=503, text="shutting down"), kind
        except Exception:
            log.warning("malformed request: dispatch failed", exc_info=True)
            return web.Response(status=400, text="malformed request"), kind
        return await to_aiohttp_response(response), kind

    async def settle(self, within: float) -> None:
        """The requests still being handled here end within ``within`` seconds or are
        cancelled, and the record being written for them is ended too: called once requests
        are refused (the worker is closing), before this loop's storage is disposed of (a
        statement still under way would leave its connection open behind the engine's back).
        A cancelled request was answered 503, or gets it: Slack sends it again."""
        await finish_or_cancel(self._in_flight - {asyncio.current_task()}, within)
        await self.deliveries.settle()

    async def _dispatch(self, bolt_request: AsyncBoltRequest, *, intake: bool) -> Any:
        if self.elsewhere is None:
            with self.worker.arriving():  # this is the turns' loop
                return await self.app.async_dispatch(bolt_request)
        if intake:
            return await self.app.async_dispatch(bolt_request)
        return await self._dispatch_elsewhere(bolt_request)

    def _late(self, dispatch: asyncio.Future[Any], kind: str) -> None:
        """A request answered 503 at the deadline: counted, logged (at most every
        LATE_LOG_SECONDS), and its handling left to finish (its outcome logged, not raised)."""
        metrics.ACKS_LATE.labels(kind).inc()
        self._late_count += 1
        now = time.monotonic()
        if now - self._late_logged >= LATE_LOG_SECONDS:
            log.warning(
                "answered %d request(s) 503 after %gs: recording them did not finish in time "
                "(is the database reachable?); Slack sends them again",
                self._late_count,
                ACK_DEADLINE_SECONDS,
            )
            self._late_count, self._late_logged = 0, now

        def finished(done: asyncio.Future[Any]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.info("a request answered late failed: %s", done.exception())

        dispatch.add_done_callback(finished)

    async def _dispatch_elsewhere(self, bolt_request: AsyncBoltRequest) -> Any:
        """A request of the full app's, dispatched on the turns' loop (where its listeners'
        database and Slack clients live)."""
        assert self.elsewhere is not None
        worker, app = self.elsewhere.worker, self.elsewhere.app

        async def dispatch() -> Any:
            with worker.arriving():
                return await app.async_dispatch(bolt_request)

        return await self.elsewhere.run(dispatch)

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
        if await self.storage.answers():
            return web.Response(text="ok")
        return web.Response(status=503, text="database unavailable")

    async def _live(self, _request: web.Request) -> web.Response:
        """Alive: this loop answers (it runs this), and so does the turns' loop within
        ``LOOP_ANSWER_SECONDS``. Never the database: a database outage restarting every
        replica would only add cold starts to it."""
        if self.elsewhere is not None:
            try:
                await asyncio.wait_for(self.elsewhere.run(_nothing), LOOP_ANSWER_SECONDS)
            except TimeoutError:
                return web.Response(status=503, text="the turns' loop does not answer")
        return web.Response(text="ok")

    async def _ready(self, _request: web.Request) -> web.Response:
        """Ready for traffic: not stopping, the database answers within its health timeout,
        and its schema is the one this build needs (``Storage.not_ready``)."""
        if self.worker.closing:
            return web.Response(status=503, text="stopping")
        reason = await self.storage.not_ready()
        if reason is not None:
            return web.Response(status=503, text=reason)
        return web.Response(text="ok")

    async def _metrics(self, _request: web.Request) -> web.Response:
        """Prometheus text; the delivery gauges as last read from the database (counters are
        this process's own, served either way)."""
        await self._count_deliveries()
        metrics.HELD_MESSAGES.set(self.worker.held)
        metrics.PARKED_MESSAGES.set(self.worker.parked)
        body, content_type = metrics.exposition()
        response = web.Response(body=body)
        response.content_type = content_type.split(";")[0]
        response.charset = "utf-8"
        return response

    async def _count_deliveries(self) -> None:
        """The delivery gauges, read from the database when they are older than
        ``METRICS_REFRESH_SECONDS`` (a database that did not answer is asked again no sooner
        either: a scraper must not pile statements onto a database in trouble)."""
        async with self._counting:
            now = time.monotonic()
            if self._counted_at is not None and now - self._counted_at < METRICS_REFRESH_SECONDS:
                return
            self._counted_at = now
            try:
                counts = await self.deliveries.counts()
            except DatabaseError:
                log.warning("/metrics: the database did not answer; delivery gauges not updated")
                return
        metrics.DELIVERIES.clear()
        metrics.DELIVERY_AGE.clear()
        oldest: dict[str, float] = {}
        for c in counts:
            metrics.DELIVERIES.labels(c.state, c.wait_reason or "").set(c.count)
            oldest[c.state] = max(oldest.get(c.state, 0.0), c.oldest_age_seconds)
        for state, age in oldest.items():
            metrics.DELIVERY_AGE.labels(state).set(age)
        metrics.WAITING_MESSAGES.set(sum(c.count for c in counts if c.state == "waiting"))


async def _nothing() -> None:
    """A no-op the turns' loop runs to show it answers."""


async def listen(
    listener: Listener,
    host: str,
    port: int,
    *,
    events: bool,
    operator: bool = True,
    api: bool = True,
    name: str = "PORT",
) -> web.AppRunner:
    """Serve ``listener`` on ``host:port``; a port that cannot be had is one config line
    (``name``: the setting that chose it)."""
    app = listener.web_app(events=events, operator=operator, api=api)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"{name}: cannot listen on {host}:{port}: {exc.strerror}") from None
    return runner
