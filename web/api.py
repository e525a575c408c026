"""The HTTP API under ``/v1`` (docs/http-api.md): sessions, their transcripts, chat.

``WebApi`` is made on the turns' loop (``serve``'s, where the conversation API and its
database engine live) and adds its routes to the listener's app, which may run on another
loop (the intake's): every handler reads its request where it arrives, then does its work on
the turns' loop in one crossing (``TurnsLoop.run``), who-is-asking included. A chat's turn is
started there and streams back through a ``Pipe`` (``web.chat``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from core.conversation import (
    WEB_PROJECT,
    Conversation,
    SessionInfo,
    Viewer,
    place,
)
from core.conversation.places import slack_ids
from core.conversation.worker import SHUTDOWN
from core.runtime import Bearer, Runtime, Settings
from web.admin import Admin
from web.auth import (
    COOKIE,
    CachedChannels,
    Caller,
    Channels,
    NoChannels,
    bearer_token,
    csrf_ok,
)
from web.chat import Chat
from web.errors import ApiError, bad_request, guarded
from web.limits import RateLimit
from web.loops import TurnsLoop
from web.recent import Recent
from web.requests import json_response, read_json, read_title, session_id_of, unknown
from web.shapes import (
    cursor,
    read_cursor,
    read_datetime,
    read_limit,
    session_json,
    ui_message,
)
from web.signin import SignIn
from web.transcript import Transcript

log = logging.getLogger(__name__)
T = TypeVar("T")

SESSIONS_PAGE, SESSIONS_MOST = 50, 100
# How long who a key acts as is answered from memory (a revoked token, an expired or signed-out
# sign-in elsewhere is refused within this), and the longest a session's summary is reused
# while its row is unchanged (a decision on a waiting call leaves the row as it is).
BEARER_SECONDS = 5.0
SUMMARY_SECONDS = 2.0
MESSAGES_PAGE, MESSAGES_MOST = 100, 500

Work = Callable[[Caller], Awaitable[T]]


class WebApi:
    """The API's routes over one runtime (see the module's docstring)."""

    def __init__(self, runtime: Runtime, channels: Channels | None = None) -> None:
        self.settings: Settings = runtime.settings
        self.runtime = runtime
        self.turns = TurnsLoop()
        self.conversations = runtime.conversations(WEB_PROJECT)
        self.access = runtime.storage.web_access
        self.channels = CachedChannels(channels or NoChannels())
        self.chats = RateLimit(self.settings.web_chats_per_minute)
        self.running: set[concurrent.futures.Future[Any]] = set()  # web turns, for a stop
        # Who a key acts as, and sessions' summaries, for a moment (web.recent).
        self.bearers: Recent[tuple[str, str], Bearer | None] = Recent(BEARER_SECONDS)
        self.summaries: Recent[int, tuple[SessionInfo, dict[str, Any]]] = Recent(SUMMARY_SECONDS)
        self.closing = False

    # -- the routes -----------------------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        chat = Chat(self)
        routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            ("GET", "/v1/me", self._me),
            ("GET", "/v1/agent_sessions", self._list),
            ("POST", "/v1/agent_sessions", self._create),
            ("GET", "/v1/agent_sessions/{id}", self._get),
            ("PATCH", "/v1/agent_sessions/{id}", self._patch),
            ("DELETE", "/v1/agent_sessions/{id}", self._delete),
            ("GET", "/v1/agent_sessions/{id}/messages", self._messages),
            ("POST", "/v1/agent_sessions/{id}/chat", chat.chat),
            ("POST", "/v1/agent_sessions/{id}/stop", chat.stop),
            ("POST", "/v1/agent_sessions/{id}/tool_approvals", chat.tool_approvals),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, guarded(handler))
        SignIn(self).add_routes(app)
        Transcript(self).add_routes(app, guarded)
        Admin(self).add_routes(app, guarded)
        app.router.add_route("*", "/v1/{tail:.*}", guarded(unknown))  # last: what is left

    async def close(self, grace: float) -> None:
        """Let running web turns finish for ``grace`` seconds, then interrupt them (each
        keeps its partial answer, as a Slack turn does at a shutdown)."""
        self.closing = True
        pending = {asyncio.wrap_future(f) for f in self.running}
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace)
            for future in late:
                future.cancel(SHUTDOWN)
            for future in late:
                with contextlib.suppress(BaseException):
                    await future

    # -- who is asking --------------------------------------------------------------------------

    async def on_turns(self, request: web.Request, work: Work[T]) -> T:
        """``work(caller)`` on the turns' loop, once the request's key says who is asking (401
        otherwise; 403 for a cookie request that changes something without its CSRF token)."""
        token = bearer_token(request.headers)
        secret = None if token is not None else request.cookies.get(COOKIE)
        method, headers = request.method, request.headers.copy()  # names in any case
        changed = request.match_info.get("id") if method != "GET" else None

        async def there() -> T:
            caller = await self.caller(token, secret)
            if caller is None:
                raise ApiError(401, "unauthenticated", "sign in, or send a valid bearer token")
            if not csrf_ok(method, headers, caller):
                raise ApiError(403, "csrf_failed", "X-CSRF-Token is missing or wrong")
            try:
                return await work(caller)
            finally:
                if changed is not None and changed.isdigit():
                    self.summaries.drop(int(changed))

        return await self.turns.run(there)

    async def caller(self, token: str | None, cookie: str | None) -> Caller | None:
        if token is None and not cookie:
            return None
        key = ("token", token) if token is not None else ("cookie", cookie or "")
        bearer = self.bearers.get(key)
        if bearer is None:
            if token is not None:
                bearer = await self.access.bearer_of_token(token)
            else:
                bearer = await self.access.bearer_of_cookie(key[1])
            if bearer is not None:  # an unknown key is asked again: it may be new elsewhere
                self.bearers.put(key, bearer)
        if bearer is None:
            return None
        team, user = slack_ids(bearer.person) or (None, None)
        admin = team is not None and user is not None and self.settings.is_admin(team, user)
        return Caller(
            bearer.user_id,
            bearer.person,
            bearer.display_name,
            admin,
            team,
            user,
            cookie if token is None else None,
        )

    async def viewer(self, caller: Caller) -> Viewer:
        channels: frozenset[str] = frozenset()
        if caller.team is not None and caller.user is not None and not caller.admin:
            try:
                channels = await self.channels.of(caller.team, caller.user)
            except Exception as exc:  # Slack unreachable: their own sessions still show
                log.warning("could not ask Slack for %s's channels: %s", caller.person, exc)
        return Viewer(caller.actor, caller.person, caller.team, channels)

    async def conversation(self, caller: Caller, session_id: int) -> Conversation:
        """The session as ``caller`` may see it (404 when they may not)."""
        return await self.conversations.seen_by(session_id, await self.viewer(caller))

    # -- /v1/me ---------------------------------------------------------------------------------

    async def _me(self, request: web.Request) -> web.StreamResponse:
        async def work(caller: Caller) -> dict[str, Any]:
            return {
                "person": caller.person,
                "teamId": caller.team,
                "userId": caller.user,
                "name": caller.name,
                "admin": caller.admin,
                "csrfToken": caller.csrf_token,
                "sessionPollSeconds": self.settings.session_poll_seconds,
                "busyPollSeconds": self.settings.busy_poll_seconds,
                "traceUrlTemplate": self.settings.trace_url_template,
            }

        return json_response(await self.on_turns(request, work))

    # -- sessions -------------------------------------------------------------------------------

    async def session_json(self, conversation: Conversation) -> dict[str, Any]:
        return (await self.sessions_json([conversation.session]))[0]

    async def sessions_json(self, sessions: list[SessionInfo]) -> list[dict[str, Any]]:
        return [
            session_json(
                summary.session,
                owner=summary.owner,
                owner_name=summary.owner_name,
                last_message_id=summary.last_message_id,
                waiting=summary.waiting,
                approval_timeout_seconds=self.settings.approval_timeout_seconds,
            )
            for summary in await self.conversations.summaries(sessions)
        ]

    async def _list(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        limit = read_limit(query.get("limit"), SESSIONS_PAGE, SESSIONS_MOST)
        scope = query.get("scope", "")
        if scope not in ("", "own", "all"):
            raise bad_request("scope: own or all")
        after = read_cursor(query.get("cursor"))
        before = None
        if after is not None:
            last_id = after.get("id")
            if not isinstance(last_id, int):
                raise bad_request("cursor: not a cursor this API gave out")
            before = (read_datetime(after.get("at")), last_id)
        words = query.get("q") or None

        async def work(caller: Caller) -> dict[str, Any]:
            if scope == "all" and not caller.admin:
                raise ApiError(403, "forbidden", "scope=all is for admins")
            viewer = await self.viewer(caller)
            if scope == "own":
                viewer = Viewer(viewer.actor, viewer.person)
            found = await self.conversations.visible(
                viewer, everything=scope == "all", before=before, words=words, limit=limit
            )
            next_cursor = None
            if len(found) == limit:
                last = found[-1]
                next_cursor = cursor({"at": last.updated_at.isoformat(), "id": last.id})
            return {"data": await self.sessions_json(found), "nextCursor": next_cursor}

        return json_response(await self.on_turns(request, work))

    async def _create(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        title = read_title(body, required=False)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request("model: a string")
        served = {n for n in (self.settings.model_name, self.settings.model_provider) if n}
        if model is not None and model not in served:
            raise bad_request(f"model: this deployment serves {', '.join(sorted(served))}")

        async def work(caller: Caller) -> dict[str, Any]:
            owner = await self.conversations.person(
                caller.person, admin=caller.admin, display_name=caller.name
            )
            key = f"{caller.person}/{uuid.uuid4()}"
            made = await self.conversations.open(key, owner=owner, title=title)
            return await self.session_json(made)

        return json_response(await self.on_turns(request, work), status=201)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        """The probe clients poll: one read of the session's row, and the rest of its summary
        (last message, waiting call, owner) reused while that row is unchanged (every message,
        claim, release and rename changes it) and younger than ``SUMMARY_SECONDS``."""
        session_id = session_id_of(request)

        async def work(caller: Caller) -> dict[str, Any]:
            mark = self.summaries.mark
            conversation = await self.conversation(caller, session_id)
            kept = self.summaries.get(session_id)
            if kept is not None and kept[0] == conversation.session:
                return kept[1]
            shown = await self.session_json(conversation)
            self.summaries.put(session_id, (conversation.session, shown), mark)
            return shown

        return json_response(await self.on_turns(request, work))

    async def _patch(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        body = await read_json(request)
        title = read_title(body, required=True)
        assert title is not None

        async def work(caller: Caller) -> dict[str, Any]:
            conversation = await self.conversation(caller, session_id)
            await conversation.rename(title, caller.actor)
            return await self.session_json(await self.conversation(caller, session_id))

        return json_response(await self.on_turns(request, work))

    async def _delete(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)

        async def work(caller: Caller) -> None:
            conversation = await self.conversation(caller, session_id)
            await conversation.delete(caller.actor)

        await self.on_turns(request, work)
        return web.Response(status=204)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        limit = read_limit(request.query.get("limit"), MESSAGES_PAGE, MESSAGES_MOST)
        after = read_cursor(request.query.get("cursor"))
        position = -1
        if after is not None:
            found = after.get("p")
            if not isinstance(found, int):
                raise bad_request("cursor: not a cursor this API gave out")
            position = found

        async def work(caller: Caller) -> dict[str, Any]:
            conversation = await self.conversation(caller, session_id)
            page = await conversation.page(after_position=position, limit=limit)
            thread = place(conversation.session).thread
            team = thread.team if thread is not None else None
            template = self.settings.trace_url_template
            next_cursor = cursor({"p": page[-1][0].position}) if len(page) == limit else None
            return {
                "data": [
                    ui_message(m, team=team, created_at=at, trace_template=template)
                    for m, at in page
                ],
                "nextCursor": next_cursor,
            }

        return json_response(await self.on_turns(request, work))
