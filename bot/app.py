"""The Bolt app: Slack payload in, a call of the conversation API (or the delivery worker), out.

A message for the agent is recorded durably inside its listener, which Bolt runs before it
acknowledges (``process_before_response``): once Slack hears "received", the record guarantees
an answer (``core.conversation.worker``); if the record cannot be written, the request fails with
500 and the Events API sends it again (Slack never sends a click again: a click's listener answers
its own failures). The answer itself is worked out after the acknowledgement, as is
everything the other listeners do (they acknowledge first and hand the work to a task).

``serve`` runs the message listeners twice over: in the intake's own small app
(``add_message_listeners`` on ``bolt_app``, on the intake thread: ``bot.intake``) for HTTP, and
in the full app (``build_app``) for Socket Mode and the in-process harness.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, cast

import aiohttp
from slack_bolt.async_app import AsyncApp
from slack_bolt.authorization.async_authorize import AsyncInstallationStoreAuthorize
from slack_bolt.context.ack.async_ack import AsyncAck
from slack_bolt.context.async_context import AsyncBoltContext
from slack_bolt.context.respond.async_respond import AsyncRespond
from slack_bolt.listener.async_builtins import AsyncTokenRevocationListeners
from slack_bolt.middleware.authorization.async_single_team_authorization import (
    AsyncSingleTeamAuthorization,
)
from slack_bolt.oauth.async_oauth_settings import AsyncOAuthSettings
from slack_bolt.response import BoltResponse
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from bot import payload
from bot import texts as text
from bot.answers import tell
from bot.approvals import ApprovalCards
from bot.files import SharedFile, shared_files
from bot.post import Post, external_user, thread_key
from bot.shortcuts import Shortcuts
from bot.slack_api import observed, web_client
from bot.tasks import BackgroundWork
from core.conversation import Conversations, DeliveryRecord, slack_message_id
from core.conversation.intake import Incoming
from core.conversation.surface import ClickAnswer
from core.conversation.worker import DeliveryWorker
from core.errors import DatabaseError, DatabaseValueRefused, InvalidRequest
from core.runtime import Settings

log = logging.getLogger(__name__)

_LEADING_MENTION = re.compile(r"^\s*<@[A-Z0-9]+>")
# Message subtypes that are a person talking; everything else (edits, deletions, bot messages,
# joins) starts no turn.
_HUMAN_SUBTYPES = frozenset({None, "file_share", "thread_broadcast"})


class _TokenFromClient(logging.Filter):
    """Bolt warns that ``SLACK_BOT_TOKEN`` (which it reads itself) is unused when a client is
    given; the client is given precisely so it carries that token and SLACK_API_URL."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`token` will be unused" not in record.getMessage()


logging.getLogger("slack_bolt.AsyncApp").addFilter(_TokenFromClient())


class Receiver(Protocol):
    """What the message listener records a message with: the delivery worker itself (on its
    loop), or the intake on a loop of its own (``bot.intake``)."""

    async def known_thread(self, thread: str) -> bool: ...

    async def receive(self, message: Incoming, client: AsyncWebClient) -> None: ...


def bolt_app(
    settings: Settings,
    *,
    oauth_settings: AsyncOAuthSettings | None = None,
    http_session: aiohttp.ClientSession | None = None,
) -> AsyncApp:
    """A Bolt app with the error handler and middleware every one of ours has, no listeners."""
    multi = oauth_settings is not None
    client = web_client(settings, None if multi else settings.slack_bot_token, http_session)
    app = AsyncApp(
        client=client,
        # An AsyncAuthorize is taken as it is (Bolt's own check); its hint names a function.
        authorize=cast(
            Any, None if oauth_settings is None else _installs_authorize(oauth_settings, client)
        ),
        signing_secret=settings.slack_signing_secret or "",
        # bot.serve verifies HTTP requests before parsing them (Bolt parses first); Socket Mode
        # needs no signature.
        request_verification_enabled=False,
        oauth_settings=oauth_settings,
        # Listeners run before the acknowledgement: a message is recorded before Slack hears
        # "received" (they then hand the work to a task).
        process_before_response=True,
        # url_verification needs no token; everything else is authorised as usual.
        ignoring_self_events_enabled=True,
    )

    @app.error
    async def on_error(error: Exception) -> BoltResponse:
        """A listener or middleware failed. The database failing is a 500, so Slack sends an
        event again (the Events API retries; a click is never sent again: the click listeners
        answer their own failures); a payload of the wrong shape is a 400 and changed nothing."""
        if isinstance(error, DatabaseValueRefused):
            # The database refused a value the payload carried (a NUL in an id): sent again,
            # it would be refused again. Nothing was written.
            log.warning("malformed payload: %s: %s", error.code, error)
            return BoltResponse(status=400, body="malformed payload")
        if isinstance(error, DatabaseError):
            log.error("request not taken: %s", error)
            return BoltResponse(status=500, body="")
        if isinstance(error, InvalidRequest | TypeError | AttributeError | KeyError | ValueError):
            log.warning("malformed payload: %s: %s", error.__class__.__name__, error)
            return BoltResponse(status=400, body="malformed payload")
        log.error("request failed", exc_info=error)
        return BoltResponse(status=500, body="")

    @app.middleware
    async def observed_client(
        context: AsyncBoltContext, next: Callable[[], Awaitable[None]]
    ) -> None:
        """Listeners' Web API calls are counted in ``/metrics`` like every other call: Bolt
        hands each request a plain client of its own (``bot.slack_api.observed``)."""
        context["client"] = observed(context.client)
        await next()

    @app.middleware
    async def same_workspace_only(
        context: AsyncBoltContext, body: dict[str, Any], next: Callable[[], Awaitable[None]]
    ) -> BoltResponse | None:
        """Single-workspace mode: a payload from another workspace changes nothing here."""
        result = context.authorize_result
        if not multi and result is not None and result.team_id:
            team = _team_of(body)
            if team and team != result.team_id and not body.get("is_enterprise_install"):
                log.warning("dropping a payload from workspace %s", team)
                return BoltResponse(status=200, body="")
        await next()
        return None

    return app


# The most ``auth.test`` answers an app keeps (one per install token in use; a rotated token is
# a new one): past it, the oldest answer is dropped and asked again when next needed.
AUTHORIZED_KEPT = 10_000


class _Kept(dict[str, Any]):
    """Bolt's authorize cache, bounded: with token rotation every install's token changes
    twice a day, and an unbounded cache would keep every one it ever saw."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self and len(self) >= AUTHORIZED_KEPT:
            del self[next(iter(self))]
        super().__setitem__(key, value)


def _installs_authorize(
    oauth_settings: AsyncOAuthSettings, client: AsyncWebClient
) -> AsyncInstallationStoreAuthorize:
    """Multi-workspace authorisation as Bolt builds it, with its ``auth.test`` answer kept per
    token (Bolt's ``cache_enabled``, off by default): otherwise every request, a message's
    acknowledgement included, waits on a call to Slack first, and a 429 there (a second's
    ``Retry-After`` and more) can take it past the acknowledgement deadline, as it did a
    restarted replica's first message. The install is still looked up for every request, so
    an uninstalled or revoked workspace (its install deleted) is refused at once, cache or
    not."""
    assert oauth_settings.installation_store is not None  # ours always has one
    authorize = AsyncInstallationStoreAuthorize(
        installation_store=oauth_settings.installation_store,
        client_id=oauth_settings.client_id,
        client_secret=oauth_settings.client_secret,
        logger=logging.getLogger("slack_bolt.AsyncApp"),
        cache_enabled=True,
        client=client,
        user_token_resolution=oauth_settings.user_token_resolution,
    )
    authorize.authorize_result_cache = _Kept()
    return authorize


def _single_team_authorization(app: AsyncApp) -> AsyncSingleTeamAuthorization | None:
    """The app's single-workspace authorisation (a token, no OAuth), or None (OAuth installs:
    each request is authorised by its workspace's install). Bolt offers no accessor for its
    middleware; ``tests/test_operations.py`` fails if this stops finding it."""
    middleware = getattr(app, "_async_middleware_list", [])
    return next((m for m in middleware if isinstance(m, AsyncSingleTeamAuthorization)), None)


async def who_it_is(app: AsyncApp) -> AsyncSlackResponse | None:
    """``auth.test`` for the app's token, made now, or None when nothing needs it (OAuth
    installs) or Slack did not say (the error is raised: the caller decides what it costs).

    Bolt's single-workspace authorisation asks ``auth.test`` on the first request it handles and
    keeps the answer, so without this a fresh replica's first acknowledgement waited for a call
    to Slack, and for its retries: a 429's ``Retry-After`` (a second) or a 500's backoff. On a
    busy machine that went past the acknowledgement deadline (``bot.http``) and the first
    message a restarted replica took was answered 503 (the soak, 2026-12-06)."""
    if _single_team_authorization(app) is None:
        return None
    return await app.client.auth_test()


def knows_who_it_is(app: AsyncApp, auth: AsyncSlackResponse) -> None:
    """Give the app an ``auth.test`` answer already had (``who_it_is``), so no request it
    handles asks Slack first. One answer serves every app of the process on the same token
    (the intake's and the turns' loop's): it is the token's, read-only data."""
    authorization = _single_team_authorization(app)
    if authorization is not None and authorization.auth_test_result is None:
        authorization.auth_test_result = auth


def add_message_listeners(app: AsyncApp, receiver: Receiver) -> None:
    """``message`` and ``app_mention``: a message for the agent is recorded (``receiver``)."""

    async def on_message(
        event: Any,
        body: dict[str, Any],
        context: AsyncBoltContext,
        client: AsyncWebClient,
    ) -> None:
        event = payload.obj(event, "event")
        subtype = payload.string(event.get("subtype"), "event.subtype")
        if subtype not in _HUMAN_SUBTYPES or event.get("bot_id"):
            return
        user = payload.string(event.get("user"), "event.user")
        channel = payload.string(event.get("channel"), "event.channel")
        ts = payload.string(event.get("ts"), "event.ts")
        thread_ts = payload.string(event.get("thread_ts"), "event.thread_ts")
        team = payload.string(body.get("team_id"), "team_id") or payload.string(
            event.get("team"), "event.team"
        )
        raw = payload.string(event.get("text"), "event.text") or ""
        if not (user and channel and ts and team) or user == context.bot_user_id:
            return
        is_dm = event.get("channel_type") == "im" or channel.startswith("D")
        mentioned = event.get("type") == "app_mention" or (
            context.bot_user_id is not None and f"<@{context.bot_user_id}>" in raw
        )
        surface = "assistant" if event.get("assistant_thread") or thread_ts else "dm"
        stray = False
        if not is_dm:
            surface = "channel"
            if not mentioned:
                if thread_ts is None:
                    return
                # A thread the agent is not in, or one whose first message has not reached
                # any replica yet: kept a while in case it is the latter
                # (``core.conversation.worker``).
                stray = not await receiver.known_thread(thread_key(team, channel, thread_ts))
        body_text = _for_the_agent(raw, context.bot_user_id)
        files = shared_files(event)
        if not body_text and not files:
            return
        post = Post(team, channel, thread_ts or ts, ts, user, surface)
        await _receive(
            receiver, post, body_text, client, files, stray=stray, enterprise=context.enterprise_id
        )

    app.event("message")(on_message)
    app.event("app_mention")(on_message)


def build_app(
    settings: Settings,
    conversations: Conversations,
    worker: DeliveryWorker[AsyncWebClient],
    actions: Shortcuts,
    background: BackgroundWork,
    *,
    cards: ApprovalCards | None = None,
    oauth_settings: AsyncOAuthSettings | None = None,
    http_session: aiohttp.ClientSession | None = None,
) -> AsyncApp:
    app = bolt_app(settings, oauth_settings=oauth_settings, http_session=http_session)
    add_message_listeners(app, worker)

    @app.event("agent_session_stopped")
    async def on_stopped(event: Any, body: dict[str, Any]) -> None:
        """Recorded before the acknowledgement; the replica running the turn sees it."""
        event = payload.obj(event, "event")
        team = payload.string(body.get("team_id"), "team_id")
        channel = payload.string(event.get("channel"), "event.channel")
        thread_ts = payload.string(event.get("thread_ts"), "event.thread_ts")
        if team and channel and thread_ts:
            await conversations.stop(thread_key(team, channel, thread_ts))

    @app.event("agent_session_title_changed")
    async def on_renamed(event: Any, body: dict[str, Any]) -> None:
        event = payload.obj(event, "event")
        team = payload.string(body.get("team_id"), "team_id") or payload.string(
            event.get("team_id"), "event.team_id"
        )
        channel = payload.string(event.get("channel"), "event.channel")
        thread_ts = payload.string(event.get("thread_ts"), "event.thread_ts")
        title = payload.string(event.get("title"), "event.title")
        if team and channel and thread_ts and title:
            await conversations.rename(thread_key(team, channel, thread_ts), title)

    @app.event("app_context_changed")
    async def on_viewing(event: Any, body: dict[str, Any]) -> None:
        """What a person looks at beside the agent: told to the agent on their next message."""
        event = payload.obj(event, "event")
        team = payload.string(body.get("team_id"), "team_id")
        user = payload.string(event.get("user"), "event.user") or _authorized_user(body)
        context = payload.optional_obj(event.get("context"), "event.context")
        if team and user:
            await conversations.set_viewing(f"{team}:{user}", context)

    revocations = (
        AsyncTokenRevocationListeners(oauth_settings.installation_store)
        if oauth_settings is not None and oauth_settings.installation_store is not None
        else None
    )

    @app.event("app_uninstalled")
    async def on_uninstalled(body: dict[str, Any], context: AsyncBoltContext) -> None:
        """In any order with ``tokens_revoked``, any number of times: the installation goes
        (slack_sdk's store deletes it) and the workspace's running turns stop."""
        if revocations is not None:
            await revocations.handle_app_uninstalled_events(context)
        team = payload.string(body.get("team_id"), "team_id")
        if team:
            stopped = await conversations.stop_all(f"{team}/")
            log.info("app uninstalled from %s: %d running turn(s) stopped", team, stopped)

    @app.event("tokens_revoked")
    async def on_revoked(event: Any, body: dict[str, Any], context: AsyncBoltContext) -> None:
        event = payload.obj(event, "event")
        tokens = payload.optional_obj(event.get("tokens"), "event.tokens")
        if revocations is not None:
            await revocations.handle_tokens_revoked_events(event, context)
        team = payload.string(body.get("team_id"), "team_id")
        if team and tokens.get("bot"):
            await conversations.stop_all(f"{team}/")

    for ignored in ("assistant_thread_started", "assistant_thread_context_changed"):
        app.event(ignored)(_nothing)

    async def on_draft_button(
        ack: AsyncAck,
        body: dict[str, Any],
        action: dict[str, Any],
        client: AsyncWebClient,
        respond: AsyncRespond,
    ) -> None:
        await ack()
        send = payload.nested_string(action, "action_id") == text.SEND_DRAFT
        user = payload.nested_string(body, "user", "id") or ""
        value = payload.nested_string(action, "value") or ""

        async def answer(record: DeliveryRecord, came: ClickAnswer) -> None:
            words = {
                ClickAnswer.SENDING: text.draft_sending,
                ClickAnswer.DISCARDED: text.draft_discarded,
                ClickAnswer.GONE: text.draft_gone,
            }[came]()
            await _answer_click(client, Post.from_context(record.context), respond, words)

        background.spawn(worker.click(value, user, send, client, answer))

    app.action(text.SEND_DRAFT)(on_draft_button)
    app.action(text.DISCARD_DRAFT)(on_draft_button)

    async def on_approval_button(
        ack: AsyncAck,
        body: dict[str, Any],
        action: dict[str, Any],
        client: AsyncWebClient,
        respond: AsyncRespond,
    ) -> None:
        """Approve / Deny on a card: decided and recorded, then acknowledged; a refusal is an
        ephemeral and changes nothing. Slack never sends a click again (not after a 500, not
        after a time-out), so a failure to decide or record is acknowledged too and said to
        the clicker, who can click again: the decision is conditional, so a second click
        finds it decided and records it once. A decision recorded but not handed on (the
        database failed in between) is also picked up by the left-behind pass."""
        if cards is None:
            await ack()
            return
        try:
            refusal = await cards.clicked(body, action, client, worker)
        except DatabaseError as exc:
            log.error("approval click not recorded: %s", exc)
            refusal = text.approval_not_recorded()
        await ack()
        value = payload.nested_string(action, "value") or ""
        if refusal is not None:
            user = payload.nested_string(body, "user", "id") or ""
            channel = payload.nested_string(body, "channel", "id") or ""
            thread_ts = payload.nested_string(body, "message", "thread_ts") or ""
            team = payload.nested_string(body, "team", "id") or ""
            post = Post.of_thread(thread_key(team, channel, thread_ts), user)
            if post is not None:
                background.spawn(_answer_click(client, post, respond, refusal, replace=False))
        background.spawn(cards.refresh(value, client))

    app.action(text.APPROVE)(on_approval_button)
    app.action(text.DENY)(on_approval_button)

    async def on_show_call(
        ack: AsyncAck, body: dict[str, Any], action: dict[str, Any], client: AsyncWebClient
    ) -> None:
        """*Show all* on a card, Previous / Next in its modal: the whole call (a modal)."""
        await ack()
        if cards is not None:
            background.spawn(cards.show_call(body, action, client))

    app.action(text.SHOW_CALL)(on_show_call)
    app.action(text.CALL_PAGE)(on_show_call)

    @app.action(re.compile(f"^{text.COMPACT_PICK}:"))
    async def on_compact_pick(
        ack: AsyncAck,
        body: dict[str, Any],
        action: dict[str, Any],
        client: AsyncWebClient,
        respond: AsyncRespond,
    ) -> None:
        await ack()
        value = payload.nested_string(action, "value") or ""
        background.spawn(actions.compact_picked(body, value, client, respond))

    @app.action(text.FEEDBACK)
    async def on_feedback(
        ack: AsyncAck, body: dict[str, Any], action: dict[str, Any], client: AsyncWebClient
    ) -> None:
        await ack()
        value = payload.nested_string(action, "value") or ""
        team = payload.nested_string(body, "team", "id") or ""
        user = payload.nested_string(body, "user", "id") or ""
        channel = payload.nested_string(body, "channel", "id") or ""
        thread_ts = payload.nested_string(body, "message", "thread_ts")
        background.spawn(_vote(conversations, value, team, user, channel, thread_ts, client))

    @app.view(text.REWIND_CONFIRM)
    async def on_rewind_confirmed(
        ack: AsyncAck, body: dict[str, Any], client: AsyncWebClient
    ) -> None:
        await ack()  # closes the modal
        key = payload.nested_string(body, "view", "private_metadata") or ""
        user = payload.nested_string(body, "user", "id") or ""
        team = payload.nested_string(body, "team", "id") or ""
        background.spawn(actions.rewind_confirmed(key, user, team, client))

    for callback_id, handler in (
        ("rewind_session", actions.rewind),
        ("fork_session", actions.fork),
        ("compact_session", actions.compact_shortcut),
    ):
        app.shortcut(callback_id)(_shortcut(background, handler))

    @app.command("/compact")
    async def on_compact(ack: AsyncAck, body: dict[str, Any], client: AsyncWebClient) -> None:
        await ack()
        background.spawn(actions.compact_command(body, client))

    return app


async def _nothing() -> None:
    """Events the app subscribes to but has nothing to do for (acknowledged)."""


def _shortcut(
    background: BackgroundWork,
    handler: Callable[[dict[str, Any], AsyncWebClient], Coroutine[Any, Any, None]],
) -> Callable[..., Awaitable[None]]:
    async def listener(ack: AsyncAck, body: dict[str, Any], client: AsyncWebClient) -> None:
        await ack()
        background.spawn(handler(body, client))

    return listener


async def _receive(
    worker: Receiver,
    post: Post,
    body: str,
    client: AsyncWebClient,
    files: list[SharedFile],
    *,
    stray: bool,
    enterprise: str | None = None,
) -> None:
    """A message for the agent becomes a delivery record (before the acknowledgement).
    ``enterprise``: the Enterprise Grid org, so a take-over finds an org-wide install."""
    extra: dict[str, Any] = {"enterprise": enterprise} if enterprise else {}
    if not stray:
        extra["files"] = [f.as_dict() for f in files]
    message = Incoming(
        event_key=post.ref,
        thread_key=post.thread,
        author=post.user,
        message_id=slack_message_id(post.team, post.channel, post.ts),
        # A stray keeps where and by whom only: its words are read back from Slack if it is
        # ever adopted (``ThreadAnswers.words``), and most strays never are.
        text="" if stray else body,
        context={**post.context(), **extra},
        stray=stray,
    )
    await worker.receive(message, client)


async def _answer_click(
    client: AsyncWebClient,
    post: Post,
    respond: AsyncRespond | None,
    body: str,
    *,
    replace: bool = True,
) -> None:
    """Replace the clicked ephemeral (its ``response_url``), or answer the clicker with an
    ephemeral (``replace=False``: the clicked message is everyone's); a new one when that
    fails."""
    if respond is not None:
        try:
            if replace:
                await respond(replace_original=True, text=body)
            else:
                await respond(response_type="ephemeral", replace_original=False, text=body)
            return
        except Exception as exc:  # an expired or unreachable response_url
            log.info("could not replace the clicked offer: %s", exc)
    await tell(client, post, body)


async def _vote(
    conversations: Conversations,
    value: str,
    team: str,
    user: str,
    channel: str,
    thread_ts: str | None,
    client: AsyncWebClient,
) -> None:
    """A feedback button: the vote is stored against the answer it is on (the button's
    value names it) and acknowledged to the voter."""
    verdict, _, message_id = value.partition(":")
    stored = await conversations.vote(message_id, external_user(team, user), verdict)
    if thread_ts is not None and channel:
        post = Post(team, channel, thread_ts, thread_ts, user, "channel")
        await tell(client, post, text.vote_noted(verdict) if stored else text.vote_gone())


def _authorized_user(body: dict[str, Any]) -> str | None:
    """The person an event is about when it does not name one (``authorizations``)."""
    found = body.get("authorizations")
    if isinstance(found, list) and found and isinstance(found[0], dict):
        return payload.string(found[0].get("user_id"), "authorizations[0].user_id")
    return None


def _for_the_agent(raw: str, bot_user_id: str | None) -> str:
    """The text the agent is given: the mention that addressed it removed, other people's
    mentions kept (who was named matters), and NUL dropped (no database stores it in text;
    Slack never sends it)."""
    raw = raw.replace(f"<@{bot_user_id}>", "") if bot_user_id else _LEADING_MENTION.sub("", raw)
    return raw.replace("\x00", "").strip()


def _team_of(body: dict[str, Any]) -> str | None:
    team = body.get("team_id")
    if isinstance(team, str):
        return team
    nested = body.get("team")
    if isinstance(nested, dict) and isinstance(nested.get("id"), str):
        return str(nested["id"])
    return None
