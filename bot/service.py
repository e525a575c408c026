"""Everything one ``serve`` process runs for Slack, built on the core runtime.

The core's ``Runtime`` (database, stores, providers, agent) is made from settings in one place;
this adds what is Slack's own: the Slack conversations and their delivery worker, the Bolt app
and its listeners, the Web API's HTTP session, and multi-workspace installs. Tests and the demo
build one the same way ``serve`` does.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web
from slack_bolt.async_app import AsyncApp
from slack_bolt.oauth.async_oauth_settings import AsyncOAuthSettings
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from bot.answers import ThreadAnswers
from bot.app import build_app, knows_who_it_is, who_it_is
from bot.approvals import ApprovalCards
from bot.channels import SlackChannels
from bot.http import Listener
from bot.installations import InstallStores, open_install_stores
from bot.post import PROJECT, SURFACE
from bot.shortcuts import Shortcuts
from bot.slack_api import http_session, web_client
from bot.tasks import BackgroundWork
from core.conversation.intake import Intake
from core.conversation.rounds import ApprovalRounds
from core.conversation.worker import DeliveryWorker
from core.errors import ConfigError, DatabaseError
from core.runtime import Runtime, Settings, Storage, metrics
from web.api import WebApi

log = logging.getLogger(__name__)

# ``Bot.ask_who_it_is`` at start: past this (Slack slow or away), the replica starts anyway and
# its first request asks, as Bolt does by itself.
IDENTITY_SECONDS = 10.0

BOT_SCOPES = [
    "app_mentions:read",
    "assistant:write",
    "channels:history",
    "channels:read",  # the HTTP API shows a person the threads of channels they belong to
    "chat:write",
    "commands",
    "files:read",
    "groups:history",
    "groups:read",
    "im:history",
    "mpim:history",
]


def check_config(settings: Settings) -> None:
    """One line naming the variable a mode needs (never a traceback)."""
    # No state secret: Bolt for Python keeps each install's OAuth state in the database
    # (``bot.installations``) and checks it against a cookie; it signs nothing. (Bolt for
    # JavaScript's ``stateSecret`` signs a state kept nowhere else.)
    oauth = [settings.slack_client_id, settings.slack_client_secret]
    if any(oauth) and not all(oauth):
        names = ["SLACK_CLIENT_ID", "SLACK_CLIENT_SECRET"]
        missing = names.pop([bool(v) for v in oauth].index(False))
        raise ConfigError(f"{missing}: required with {names[0]} (multi-workspace OAuth installs)")
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
            "SLACK_BOT_TOKEN: required (or SLACK_CLIENT_ID and SLACK_CLIENT_SECRET for OAuth "
            "installs)"
        )


def oauth_settings(settings: Settings, installs: InstallStores) -> AsyncOAuthSettings:
    """Bolt's OAuth flow over the install stores: the same for both of ``serve``'s apps (the
    intake's and the turns' loop's), each over its own loop's stores."""
    return AsyncOAuthSettings(
        client_id=settings.slack_client_id,
        client_secret=settings.slack_client_secret,
        scopes=BOT_SCOPES,
        installation_store=installs.installations,
        state_store=installs.states,
        install_path="/slack/install",
        redirect_uri_path="/slack/oauth_redirect",
    )


async def warm(storage: Storage, intake: Intake) -> None:
    """``storage``'s connections and ``intake``'s statements ready before a listener opens on
    this loop (``Bot.warm``; the intake's thread does the same for its own). A database that
    cannot be reached now does not stop the start: it is logged, and the first message opens
    what it needs, as before (``/healthz`` and ``/readyz`` say whether it answers)."""
    try:
        await storage.warm()
        await intake.warm()
    except DatabaseError as exc:
        log.warning("the database's connections were not opened at start (%s)", exc)


class Bot:
    """Everything ``serve`` runs, built from settings (tests and the demo build one too)."""

    def __init__(
        self,
        runtime: Runtime,
        installs: InstallStores | None,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        settings = runtime.settings
        self.settings = settings
        self.runtime = runtime
        self.http = http  # the Web API's session (kept open: warm connections); ours to close
        self.installs = installs
        # The token's ``auth.test`` answer, once ``ask_who_it_is`` had it (single workspace).
        self.identity: AsyncSlackResponse | None = None
        self.conversations = runtime.conversations(PROJECT, surface=SURFACE)
        self.answers = ThreadAnswers(settings, self.conversations, self.client_for)
        self.cards = ApprovalCards(settings, self.conversations, self.client_for)
        self.rounds = ApprovalRounds(settings, self.conversations, [self.cards])
        self.answers.cards = self.cards
        self.deliveries = runtime.deliveries(SURFACE)
        metrics.REPLICA.info({"owner": self.deliveries.owner})
        self.worker: DeliveryWorker[AsyncWebClient] = DeliveryWorker(
            settings,
            self.deliveries,
            self.conversations,
            self.answers,
            max_turns=settings.max_concurrent_turns,
        )
        self.background = BackgroundWork()
        # The HTTP API under /v1 (web.api), on the turns' loop with the Slack surface.
        self.api = WebApi(runtime, SlackChannels(self.client_for))
        oauth = None if installs is None else oauth_settings(settings, installs)
        self.app: AsyncApp = build_app(
            settings,
            self.conversations,
            self.worker,
            Shortcuts(settings, self.conversations),
            self.background,
            cards=self.cards,
            oauth_settings=oauth,
            http_session=http,
        )

    @classmethod
    async def open(cls, settings: Settings) -> Bot:
        check_config(settings)
        runtime = await Runtime.open(settings)
        try:
            installs = None
            if settings.slack_client_id and settings.slack_client_secret:
                installs = await open_install_stores(runtime.storage, settings.slack_client_id)
        except BaseException:
            await runtime.close()
            raise
        return cls(runtime, installs, http_session())

    async def prepare_to_listen(self) -> None:
        """What every start does before its listener opens, so the first acknowledgement pays
        for neither: Slack asked who the token is (``ask_who_it_is``) and the database's
        connections opened (``warm``), at once. ``serve``, the demo and the tests' harness
        start alike."""
        await asyncio.gather(self.ask_who_it_is(), self.warm())

    async def warm(self) -> None:
        """The connections and statements this loop's acknowledgements use, ready before the
        first one (``Storage.warm``, ``Intake.warm``): a replica's first message otherwise
        opened them inside its 2.5 s, several round trips each, and a loaded machine
        stretched that past the deadline (tests/test_warm_start.py)."""
        await warm(self.runtime.storage, self.worker.intake)

    async def ask_who_it_is(self) -> None:
        """``auth.test`` once, before the listener opens, for every Bolt app of the process
        (this one now, the intake's as it is built: ``bot.intake``): otherwise the first request
        each app handles asks Slack inside its acknowledgement (``bot.app.who_it_is``). Slack
        failing to say (away, slow, refusing the token) does not stop the start: it is logged,
        and the first request asks again, as before."""
        try:
            async with asyncio.timeout(IDENTITY_SECONDS):
                auth = await who_it_is(self.app)
        except Exception as exc:  # SlackApiError, a connection error, the timeout
            log.warning(
                "auth.test at start failed (%s): the first Slack request asks again, "
                "inside its acknowledgement",
                exc.__class__.__name__ if isinstance(exc, TimeoutError) else exc,
            )
            return
        if auth is not None:
            knows_who_it_is(self.app, auth)
            self.identity = auth

    @property
    def listener(self) -> Listener:
        return Listener(
            self.settings,
            self.app,
            self.worker,
            self.runtime.storage,
            self.deliveries,
            oauth=self.installs is not None,
            api=self.api,
        )

    def web_app(self, *, events: bool = True) -> web.Application:
        """The HTTP listener's routes (``bot.http``)."""
        return self.listener.web_app(events=events)

    def start(self) -> None:
        """Begin renewing leases and taking over what stopped or dead replicas left, and
        keeping approval cards up to date."""
        self.worker.start()
        self.cards.start(self.worker)
        if self.runtime.tools is not None:  # no MCP servers: no call ever waits for a person
            self.rounds.start()

    def stop_taking(self) -> None:
        """Refuse what Slack sends from now on (503: sent again, maybe to another replica) and
        hand nothing new to background work; ``close`` begins with this, and ``serve`` calls it
        first to settle its intake's requests before the bot closes."""
        self.background.closing = True
        self.worker.stop_taking()

    async def close(self, grace: float | None = None) -> None:
        """Stop taking work, let the requests still being handled on this loop end (a record
        in flight after a 503 included: ``DeliveryWorker.stop``) and running turns finish for
        the grace period, interrupt the rest (their partial answers kept), then close
        everything: the database last, once nothing uses it. ``grace``: what is left of
        ``SHUTDOWN_GRACE_SECONDS`` (all of it unless given)."""
        if grace is None:
            grace = self.settings.shutdown_grace_seconds
        self.stop_taking()
        await self.rounds.stop()
        await asyncio.gather(
            self.worker.stop(grace), self.background.shutdown(grace), self.api.close(grace)
        )
        if self.installs is not None:
            await self.installs.dispose()
        await self.runtime.close()
        if self.http is not None:
            await self.http.close()

    async def client_for(self, team: str, enterprise: str | None = None) -> AsyncWebClient | None:
        """A Web API client for a workspace (for records taken over outside any request).

        In an Enterprise Grid org (``enterprise``) the app is installed either in the
        workspace itself or once for the whole org; slack_sdk stores an org-wide install
        without a team, so that is looked up second, as Bolt's own authorisation does."""
        if self.installs is None:
            return self.app.client
        store = self.installs.installations
        bot = await store.async_find_bot(enterprise_id=enterprise, team_id=team)
        if bot is None and enterprise:
            bot = await store.async_find_bot(
                enterprise_id=enterprise, team_id=None, is_enterprise_install=True
            )
        if bot is None or not bot.bot_token:
            return None
        return web_client(self.settings, bot.bot_token, self.http)
