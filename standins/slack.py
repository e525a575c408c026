"""A stand-in for Slack: its Web API as a server, and what Slack sends to an app, signed.

``SlackStandIn`` is a real HTTP server on 127.0.0.1 (``SLACK_API_URL`` points at ``api_url``)
that answers like Slack (``ok: true``, fresh ``ts`` values, the streaming methods, Socket
Mode's WebSocket, file downloads, ``response_url`` posts) and records every call (``calls``:
method, decoded arguments, answer). It keeps each message as a person would read it
(``messages``: mrkdwn entities decoded, Markdown as written, task cards, blocks, buttons;
ephemerals only for the person they were shown to) and every Slack control sequence that
reached a field Slack would act on (``controls``). It is not a test double of all of Slack's
rules; the ones it keeps: one ``markdown_text`` holds at most 12,000 characters and a message
at most 40,000 (``msg_too_long``; a longer mrkdwn ``text`` is cut, as Slack does), a stopped
stream answers ``message_not_in_streaming_state``, ``streaming=False`` answers
``chat.startStream`` as a workspace without streaming does, and Block Kit's limits answer
``invalid_blocks`` (``block_limits``: 50 blocks a message, 100 a modal, 3,000 characters a
section's text, a button's value 2,000 and its label 75, 25 elements an actions block, 10 a
context block, 24 characters a modal's title).

Faults: ``SlackFaults`` answers a share of calls as an overloaded Slack does, 429 with
``Retry-After`` or 500 (the call is then not carried out, and is kept in ``faulted``, apart
from ``calls``), spread evenly (``FaultSchedule``); every call is timed (``Call.at``);
per method, ``fail_next`` (HTTP statuses before answering normally; 0 drops the connection),
``errors`` (``ok: false`` every time), ``rate_limit_next`` (429s, each with the
``Retry-After`` seconds given), ``hold`` (the call is carried out but its answer waits for an
event) and ``intercept`` (awaited before each call is answered).

``signed_headers`` is the one place that signs a request as Slack does (v0 HMAC-SHA256 over
``v0:timestamp:body``); ``SlackClient`` sends events, interactions and commands with it.
``python -m standins.slack`` runs the stand-in in a process of its own and prints its URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import itertools
import json
import re
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from standins.faults import FaultSchedule
from standins.server import LocalServer, run_forever

MARKDOWN_LIMIT = 12_000
MESSAGE_LIMIT = 40_000
# Block Kit's limits (docs.slack.dev, reference/block-kit): what ``block_limits`` checks.
MESSAGE_BLOCKS = 50
MODAL_BLOCKS = 100
SECTION_TEXT = 3000
BUTTON_VALUE = 2000
BUTTON_TEXT = 75
ACTIONS_ELEMENTS = 25
CONTEXT_ELEMENTS = 10
MODAL_TITLE = 24


def block_limits(blocks: Any, *, modal: bool = False) -> str | None:
    """The first of Block Kit's limits ``blocks`` break (a message's, or a modal's), or None."""
    if not isinstance(blocks, list):
        return None
    if len(blocks) > (MODAL_BLOCKS if modal else MESSAGE_BLOCKS):
        return f"{len(blocks)} blocks"
    for block in blocks:
        if not isinstance(block, dict):
            return "a block that is not an object"
        kind = block.get("type")
        inner = block.get("text")
        long_text = isinstance(inner, dict) and len(str(inner.get("text", ""))) > SECTION_TEXT
        if kind == "section" and long_text:
            return "a section's text past 3,000 characters"
        elements = block.get("elements") or []
        if kind == "actions" and len(elements) > ACTIONS_ELEMENTS:
            return "an actions block of more than 25 elements"
        if kind == "context" and len(elements) > CONTEXT_ELEMENTS:
            return "a context block of more than 10 elements"
        for element in elements:
            if isinstance(element, dict) and element.get("type") == "button":
                if len(str(element.get("value", ""))) > BUTTON_VALUE:
                    return "a button's value past 2,000 characters"
                label = element.get("text") or {}
                if len(str(label.get("text", ""))) > BUTTON_TEXT:
                    return "a button's label past 75 characters"
    return None


# What Slack acts on in a message: mentions, channel links, special mentions, labelled links.
CONTROL = re.compile(r"<(?:[!@#][^>\s]*|[A-Za-z][A-Za-z0-9+.\-]*:[^>|\s]*\|[^>]*)>")

TEAM = "T1"
BOT_USER = "UBOT"
BOT_ID = "BBOT"
BOT_TOKEN = "xoxb-test"
SIGNING_SECRET = "test-signing-secret"
UNUSED_URL = "http://127.0.0.1:1/unused"  # a response_url nothing should call
_POSTS = ("chat.postMessage", "chat.startStream", "chat.postEphemeral")
_EDITS = ("chat.update", "chat.appendStream", "chat.stopStream")
_PERSON_TS = itertools.count(1)


@dataclass(frozen=True)
class SlackFaults:
    rate_limited: float = 0.0  # share of calls answered 429 with Retry-After: 1
    server_error: float = 0.0  # share of calls answered 500


@dataclass(frozen=True)
class Call:
    method: str
    args: dict[str, Any]
    result: dict[str, Any]
    at: float = field(default_factory=time.monotonic, compare=False)  # when it arrived

    @property
    def text(self) -> str:
        return str(self.args.get("text") or self.args.get("markdown_text") or "")


@dataclass
class Message:
    """One message as a Slack client shows it (an ephemeral only to ``visible_to``)."""

    ts: str
    channel: str
    thread_ts: str | None
    text: str = ""
    author: str = "agent"  # or the person's user id
    visible_to: str | None = None
    streaming: bool = False  # a stream that was started and not (yet) stopped
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # task cards, by id
    blocks: list[dict[str, Any]] = field(default_factory=list)
    buttons: list[str] = field(default_factory=list)  # its buttons' labels
    values: list[str] = field(default_factory=list)  # "action_id\0value", one per button

    def as_slack(self) -> dict[str, Any]:
        """The message as ``conversations.replies`` lists it."""
        who = {"bot_id": BOT_ID, "user": BOT_USER} if self.author == "agent" else {}
        return {"ts": self.ts, "text": self.text, "user": self.author, **who}


def _unescape(mrkdwn: str) -> str:
    return mrkdwn.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def _chunks(args: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in args.get("chunks") or [] if isinstance(c, dict)]


def shown_text(args: dict[str, Any]) -> str:
    """What a message's arguments show: ``markdown`` blocks if any, else Markdown as written
    or mrkdwn decoded (cut at Slack's limit), then the text of ``markdown_text`` chunks."""
    markdown = [b for b in args.get("blocks") or [] if b.get("type") == "markdown"]
    if markdown:
        return "".join(str(b.get("text", "")) for b in markdown)
    text = str(args.get("markdown_text") or "")
    if "text" in args and "markdown_text" not in args:
        text = _unescape(str(args["text"]))[:MESSAGE_LIMIT]
    return text + "".join(
        str(c.get("text") or "") for c in _chunks(args) if c.get("type") == "markdown_text"
    )


def _buttons(blocks: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    labels: list[str] = []
    values: list[str] = []
    for block in blocks:
        for element in block.get("elements", []) if isinstance(block, dict) else []:
            if element.get("type") == "button":
                labels.append(str(element["text"]["text"]))
                values.append(f"{element['action_id']}\x00{element.get('value', '')}")
    return labels, values


class SlackStandIn(LocalServer):
    def __init__(
        self,
        team: str = TEAM,
        faults: SlackFaults | None = None,
        *,
        streaming: bool = True,
        history: bool = False,
    ) -> None:
        """``history``: ``conversations.replies`` lists the thread's messages as kept here
        (the demo and the soak); without it, only what a test put in ``threads``."""
        super().__init__()
        self.team = team
        self.streaming = streaming
        self.history = history
        self.faults = faults or SlackFaults()
        self.injected: Counter[str] = Counter()  # faults answered, by status
        self._schedule = FaultSchedule(
            rate_limited=self.faults.rate_limited, server_error=self.faults.server_error
        )
        self.calls: list[Call] = []
        # Calls answered with a scheduled fault (``SlackFaults``): they changed nothing, so
        # they are kept apart from ``calls``; a report of what happened to a reply reads both.
        self.faulted: list[Call] = []
        self.messages: dict[str, Message] = {}  # by ts
        self.views: list[dict[str, Any]] = []  # modals the app opened (views.open)
        # Per method: the Retry-After seconds of 429s to answer before answering normally.
        self.rate_limit_next: dict[str, list[int]] = {}
        # Per method: HTTP statuses to answer before answering normally (0 drops the
        # connection without an answer), and Slack errors (``ok: false``) answered every time.
        self.fail_next: dict[str, list[int]] = {}
        self.errors: dict[str, str] = {}
        # Streams Slack itself ended (its stop button): they can only be edited now.
        self.stopped_streams: set[str] = set()
        # Files the app may download (GET /files/NAME): name -> (bytes, content type); a
        # request without the bot token gets Slack's HTML sign-in page.
        self.files: dict[str, tuple[bytes, str]] = {}
        # Methods whose answer is held back until the event is set (Slack carried the call
        # out; the app has not heard so yet).
        self.hold: dict[str, asyncio.Event] = {}
        # What conversations.replies answers, by thread ts (ahead of ``history``).
        self.threads: dict[str, list[dict[str, Any]]] = {}
        self.responses: list[dict[str, Any]] = []  # what the app sent to response_urls
        # Awaited with each call's method and arguments before it is answered (a test acting
        # while the app waits on a call).
        self.intercept: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
        self.controls: list[str] = []  # control sequences that reached a field Slack acts on
        self.sockets: list[web.WebSocketResponse] = []
        self.socket_acks: list[dict[str, Any]] = []
        self.changed = asyncio.Event()  # set on every call recorded
        self._ts = itertools.count(1)
        # Sign in with Slack: the authorize page (``authorize_url``) signs this person in at
        # once and sends the browser back with a code; ``openid.connect.token`` and
        # ``openid.connect.userInfo`` answer for it. ``members``: users.conversations, by user.
        self.sign_in_as = "U1"
        self.names: dict[str, str] = {}
        self.members: dict[str, list[str]] = {}
        self._codes: dict[str, str] = {}  # code -> user

    @property
    def api_url(self) -> str:
        return self.url + "/api/"

    @property
    def authorize_url(self) -> str:
        """Sign in with Slack's authorize page (``SLACK_OPENID_AUTHORIZE_URL``)."""
        return self.url + "/openid/connect/authorize"

    async def _authorize(self, request: web.Request) -> web.Response:
        """The person ``sign_in_as`` agrees at once: back to ``redirect_uri`` with a code and
        the state, as Slack sends them."""
        query = request.query
        redirect = query.get("redirect_uri", "")
        if (
            query.get("response_type") != "code"
            or not redirect
            or "openid" not in query.get("scope", "")
        ):
            return web.Response(status=400, text="invalid authorize request")
        code = f"code-{next(self._ts)}"
        self._codes[code] = self.sign_in_as
        back = (
            redirect
            + ("&" if "?" in redirect else "?")
            + urllib.parse.urlencode({"code": code, "state": query.get("state", "")})
        )
        raise web.HTTPFound(back)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/api/{method}", self._handle)
        app.router.add_get("/api/{method}", self._handle)  # slack_sdk reads some with GET
        app.router.add_get("/socket", self._socket)
        app.router.add_get("/openid/connect/authorize", self._authorize)
        app.router.add_get("/files/{name}", self._file)
        app.router.add_post("/response/{key}", self._response)

    def release(self) -> None:
        for held in self.hold.values():
            held.set()

    async def stop(self) -> None:
        self.release()
        for ws in self.sockets:
            await ws.close()
        await super().stop()

    def next_ts(self) -> str:
        return f"1800000000.{next(self._ts):06d}"

    # -- Socket Mode: apps.connections.open hands out this server's WebSocket ------------------

    async def _socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.append(ws)
        await ws.send_json({"type": "hello", "num_connections": 1, "debug_info": {}})
        self.changed.set()
        async for frame in ws:
            if frame.type == aiohttp.WSMsgType.TEXT:
                self.socket_acks.append(json.loads(frame.data))
                self.changed.set()
        return ws

    async def push(self, envelope: dict[str, Any]) -> None:
        """Send an envelope to the app over its Socket Mode connection."""
        for ws in self.sockets:
            if not ws.closed:
                await ws.send_json(envelope)
                return
        raise AssertionError("no Socket Mode connection")

    @property
    def response_url(self) -> str:
        """Where interactive payloads' ``response_url`` points (replies are recorded)."""
        return self.url + "/response/1"

    async def _response(self, request: web.Request) -> web.Response:
        self.responses.append(dict(await request.json()))
        self.changed.set()
        return web.Response(text="ok")

    def file_url(self, name: str) -> str:
        return f"{self.url}/files/{name}"

    async def _file(self, request: web.Request) -> web.Response:
        found = self.files.get(request.match_info["name"])
        if found is None:
            return web.Response(status=404)
        if request.headers.get("Authorization") != f"Bearer {BOT_TOKEN}":
            login = "<!DOCTYPE html><html><body>Sign in to Slack</body></html>"
            return web.Response(text=login, content_type="text/html")
        data, content_type = found
        return web.Response(body=data, content_type=content_type)

    # -- the Web API ----------------------------------------------------------------------------

    def _record(self, method: str, args: dict[str, Any], result: dict[str, Any]) -> None:
        self.calls.append(Call(method, args, result))
        self.changed.set()

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        if request.method == "GET":
            args: dict[str, Any] = dict(request.query)
        elif request.content_type == "application/json":
            args = dict(await request.json())
        else:  # slack_sdk sends some methods' arguments in the query string (chat.delete)
            args = {**request.query, **dict(await request.post())}
        for key in ("blocks", "metadata", "view", "chunks"):
            if isinstance(args.get(key), str):
                args[key] = json.loads(args[key])
        if method == "openid.connect.userInfo":
            bearer = request.headers.get("Authorization", "").removeprefix("Bearer ")
            args["token"] = args.get("token") or bearer
        if self.intercept is not None:
            await self.intercept(method, args)
        fault = self._schedule.next()
        if fault is not None:
            self.faulted.append(Call(method, args, {"ok": False, "error": fault}))
        if fault == "rate_limited":
            self.injected["429"] += 1
            return web.json_response(
                {"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": "1"}
            )
        if fault == "server_error":
            self.injected["500"] += 1
            return web.json_response({"ok": False, "error": "fatal_error"}, status=500)
        statuses = self.fail_next.get(method)
        if statuses:
            status = statuses.pop(0)
            self._record(method, args, {"ok": False, "error": f"http_{status}"})
            if status == 0:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)
            return web.json_response({"ok": False, "error": "fatal_error"}, status=status)
        if method in self.errors:
            failed = {"ok": False, "error": self.errors[method]}
            self._record(method, args, failed)
            return web.json_response(failed)
        waits = self.rate_limit_next.get(method)
        if waits:
            retry_after = waits.pop(0)
            self.calls.append(Call(method, args, {"ok": False, "error": "ratelimited"}))
            return web.json_response(
                {"ok": False, "error": "ratelimited"},
                status=429,
                headers={"Retry-After": str(retry_after)},
            )
        result = self._limits(method, args) or self._answer(method, args)
        if result.get("ok"):
            self._keep(method, args, result)
        self._record(method, args, result)
        held = self.hold.get(method)
        if held is not None:
            await held.wait()
        return web.json_response(result)

    def _answer(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        channel = args.get("channel") or args.get("channel_id")
        if method == "auth.test":
            return {
                "ok": True,
                "url": "https://test.slack.com/",
                "team": "Test",
                "user": "agent",
                "team_id": self.team,
                "user_id": BOT_USER,
                "bot_id": BOT_ID,
            }
        if method == "oauth.v2.access":
            return {
                "ok": True,
                "app_id": "A1",
                "authed_user": {"id": "U1"},
                "scope": "chat:write,app_mentions:read",
                "token_type": "bot",
                "access_token": "xoxb-installed",
                "bot_user_id": BOT_USER,
                "team": {"id": self.team, "name": "Test"},
                "enterprise": None,
                "is_enterprise_install": False,
            }
        if method == "apps.connections.open":
            return {"ok": True, "url": self.url.replace("http://", "ws://") + "/socket"}
        if method == "chat.startStream" and not self.streaming:
            return {"ok": False, "error": "unknown_method"}
        if method in ("chat.postMessage", "chat.startStream"):
            ts = self.next_ts()
            return {"ok": True, "channel": channel, "ts": ts, "message": {"ts": ts}}
        if method in ("chat.appendStream", "chat.stopStream"):
            found = self.messages.get(str(args.get("ts")))
            stopped = found is not None and not found.streaming
            if args.get("ts") in self.stopped_streams or stopped:
                return {"ok": False, "error": "message_not_in_streaming_state"}
            if method == "chat.stopStream":
                self.stopped_streams.add(str(args.get("ts")))
        if method in _EDITS:
            return {"ok": True, "channel": channel, "ts": args.get("ts")}
        if method == "chat.postEphemeral":
            return {"ok": True, "message_ts": self.next_ts()}
        if method == "views.open":
            self.views.append(dict(args.get("view") or {}))
            return {"ok": True, "view": {"id": f"V{self.next_ts()}"}}
        if method == "views.update":
            self.views.append(dict(args.get("view") or {}))
            return {"ok": True, "view": {"id": args.get("view_id")}}
        if method == "conversations.replies":
            return self._replies(args)
        if method == "openid.connect.token":
            user = self._codes.pop(str(args.get("code")), None)
            if user is None:
                return {"ok": False, "error": "invalid_code"}
            return {
                "ok": True,
                "access_token": f"xoxp-signin-{user}",
                "token_type": "Bearer",
                "id_token": "unsigned",
            }
        if method == "openid.connect.userInfo":
            user = str(args.get("token", "")).removeprefix("xoxp-signin-")
            if not user or user == args.get("token"):
                return {"ok": False, "error": "invalid_auth"}
            return {
                "ok": True,
                "sub": user,
                "https://slack.com/user_id": user,
                "https://slack.com/team_id": self.team,
                "name": self.names.get(user, f"Person {user}"),
            }
        if method == "users.conversations":
            user = str(args.get("user", ""))
            channels = [{"id": c} for c in self.members.get(user, [])]
            return {"ok": True, "channels": channels, "response_metadata": {"next_cursor": ""}}
        if method == "chat.delete":
            self.messages.pop(str(args.get("ts")), None)
        return {"ok": True}

    def _replies(self, args: dict[str, Any]) -> dict[str, Any]:
        """conversations.replies as Slack pages it: oldest first within ``oldest``/``latest``
        (``inclusive`` or not), ``limit`` at a time (1000 by default), an opaque cursor to go on.
        A thread not set up by hand is read from the messages posted here (``history``)."""
        inclusive = str(args.get("inclusive", "")).lower() in ("1", "true")
        oldest, latest = args.get("oldest"), args.get("latest")
        root = str(args.get("ts"))
        if root in self.threads or not self.history:
            thread = self.threads.get(root, [])
        else:
            thread = [m.as_slack() for m in self.thread(str(args.get("channel") or ""), root)]
        found = sorted(thread, key=lambda m: float(m["ts"]))
        if oldest:
            found = [m for m in found if m["ts"] > oldest or (inclusive and m["ts"] == oldest)]
        if latest:
            found = [m for m in found if m["ts"] < latest or (inclusive and m["ts"] == latest)]
        start = int(str(args.get("cursor") or "0").removeprefix("page-"))
        end = start + int(args.get("limit") or 1000)
        more = end < len(found)
        return {
            "ok": True,
            "messages": found[start:end],
            "has_more": more,
            "response_metadata": {"next_cursor": f"page-{end}" if more else ""},
        }

    def _limits(self, method: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """Slack's length rules: an error to answer, or None."""
        if method in ("views.open", "views.update", "views.push"):
            view = args.get("view") or {}
            title = str((view.get("title") or {}).get("text", ""))
            broken = block_limits(view.get("blocks"), modal=True)
            if broken is None and len(title) > MODAL_TITLE:
                broken = "a modal's title past 24 characters"
            return None if broken is None else {"ok": False, "error": "invalid_blocks"}
        if not method.startswith("chat."):
            return None
        if block_limits(args.get("blocks")) is not None:
            return {"ok": False, "error": "invalid_blocks"}
        pieces = [str(args.get("markdown_text") or "")]
        pieces += [str(c.get("text") or "") for c in _chunks(args)]
        if any(len(p) > MARKDOWN_LIMIT for p in pieces):
            return {"ok": False, "error": "msg_too_long"}
        found = self.messages.get(str(args.get("ts")))
        growing = method in ("chat.appendStream", "chat.stopStream") and found is not None
        if growing and found and len(found.text) + sum(map(len, pieces)) > MESSAGE_LIMIT:
            return {"ok": False, "error": "msg_too_long"}
        return None

    def _keep(self, method: str, args: dict[str, Any], result: dict[str, Any]) -> None:
        """What a person now sees, and any control sequence that reached them."""
        for key in ("text", "markdown_text"):
            if isinstance(args.get(key), str):
                self.controls += CONTROL.findall(args[key])
        for block in args.get("blocks") or []:
            inner = block.get("text") if isinstance(block, dict) else None
            if isinstance(inner, dict) and inner.get("type") == "mrkdwn":
                self.controls += CONTROL.findall(str(inner.get("text", "")))
            elif isinstance(inner, str):  # a markdown block
                self.controls += CONTROL.findall(inner)
        for chunk in _chunks(args):
            for key in ("text", "title", "output"):
                self.controls += CONTROL.findall(str(chunk.get(key) or ""))
        found: Message | None
        if method in _POSTS:
            ts = str(result.get("ts") or result.get("message_ts"))
            found = Message(ts, str(args.get("channel") or ""), args.get("thread_ts"))
            found.streaming = method == "chat.startStream"
            if method == "chat.postEphemeral":
                found.visible_to = str(args.get("user"))
            self.messages[ts] = found
        elif method in _EDITS:
            found = self.messages.get(str(args.get("ts")))
            if found is None:
                return
        else:
            return
        if method == "chat.update":
            found.text = shown_text(args)
        else:
            found.text += shown_text(args)
        for chunk in _chunks(args):
            if chunk.get("type") == "task_update":
                found.tasks[str(chunk["id"])] = {**found.tasks.get(str(chunk["id"]), {}), **chunk}
        if args.get("blocks"):
            found.blocks = list(args["blocks"])
        if method in _POSTS or "blocks" in args:
            # A message's buttons are those of its last blocks (an approval card's go once decided).
            found.buttons, found.values = _buttons(args.get("blocks") or [])
        if method == "chat.stopStream":
            found.streaming = False

    # -- what tests, the demo and the soak look at ----------------------------------------------

    def user_post(
        self, channel: str, user: str, text: str, thread_ts: str | None, ts: str | None = None
    ) -> str:
        """A person's message, as Slack would store it (the app hears it as an event).
        ``ts``: the one its event carries, when the sender chose it (the soak's load)."""
        ts = ts or self.next_ts()
        self.messages[ts] = Message(ts, channel, thread_ts, text, author=user)
        return ts

    def thread(self, channel: str, root: str, viewer: str | None = None) -> list[Message]:
        """The thread's messages in order, as ``viewer`` sees them (their ephemerals too)."""
        return sorted(
            (
                m
                for m in self.messages.values()
                if m.channel == channel
                and (m.thread_ts == root or m.ts == root)
                and (m.visible_to is None or m.visible_to == viewer)
            ),
            key=lambda m: m.ts,
        )

    def thread_messages(self, thread_ts: str) -> list[Message]:
        """The app's messages in a thread, oldest first, as everyone reads them."""
        return [
            m
            for m in self.messages.values()
            if m.thread_ts == thread_ts and m.author == "agent" and m.visible_to is None
        ]

    def named(self, *methods: str) -> list[Call]:
        return [c for c in self.calls if c.method in methods]

    def ephemerals(self, user: str | None = None) -> list[Call]:
        return [
            c
            for c in self.named("chat.postEphemeral")
            if user is None or c.args.get("user") == user
        ]

    def replies(self, thread_ts: str) -> list[Call]:
        """Posts of the app into a thread (top-level of the reply: postMessage or startStream)."""
        return [
            c
            for c in self.named("chat.postMessage", "chat.startStream")
            if c.args.get("thread_ts") == thread_ts
        ]

    def shown(self, thread_ts: str) -> str:
        """Everything the app showed in a thread, as one text: posted and streamed messages
        (start, appends, stop) and updates, in the order of the calls."""
        ours = {
            str(c.result.get("ts"))
            for c in self.named("chat.postMessage", "chat.startStream")
            if c.args.get("thread_ts") == thread_ts and c.result.get("ok")
        }
        return "\n".join(
            c.text
            for c in self.calls
            if c.result.get("ok")
            and (
                (
                    c.method in ("chat.postMessage", "chat.startStream")
                    and str(c.result.get("ts")) in ours
                )
                or (c.method in _EDITS and str(c.args.get("ts")) in ours)
            )
        )

    async def wait_for(self, condition: Callable[[], Any], within: float = 20.0) -> Any:
        """Wait until ``condition()`` is truthy (re-checked on each recorded call)."""
        deadline = time.monotonic() + within
        while True:
            found = condition()
            if found:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out; calls so far: {[c.method for c in self.calls]}")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.25))


# -- what Slack sends to the app ---------------------------------------------------------------


def signed_headers(
    body: str,
    *,
    secret: str = SIGNING_SECRET,
    timestamp: int | None = None,
    content_type: str = "application/json",
) -> dict[str, str]:
    """The headers Slack sends with a request: timestamp and v0 HMAC-SHA256 signature."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    digest = hmac.new(secret.encode(), f"v0:{ts}:{body}".encode(), hashlib.sha256).hexdigest()
    return {
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": f"v0={digest}",
        "Content-Type": content_type,
    }


class SlackClient:
    """Sends what Slack sends, signed, to ``{url}/slack/events``."""

    def __init__(
        self,
        url: str,
        *,
        team: str = TEAM,
        secret: str = SIGNING_SECRET,
        response_url: str | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/slack/events"
        self.team = team
        self.secret = secret
        self.response_url = response_url or UNUSED_URL
        self._session: aiohttp.ClientSession | None = None
        self._event_ids = itertools.count(1)

    async def __aenter__(self) -> SlackClient:
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    def new_ts(self) -> str:
        """Unique across clients (two clients stand for one Slack talking to two replicas)."""
        return f"1700000000.{next(_PERSON_TS):06d}"

    async def raw(
        self, body: str, headers: dict[str, str], content_type: str = "application/json"
    ) -> tuple[int, str]:
        assert self._session is not None
        async with self._session.post(
            self.url,
            data=io.BytesIO(body.encode()),
            headers={**headers, "Content-Type": content_type},
        ) as response:
            return response.status, await response.text()

    async def _signed(self, body: str, content_type: str) -> int:
        status, _ = await self.raw(body, signed_headers(body, secret=self.secret), content_type)
        return status

    async def event(
        self,
        event: dict[str, Any],
        *,
        retry: int | None = None,
        event_id: str | None = None,
        team: str | None = None,
    ) -> int:
        payload = {
            "token": "legacy",
            "team_id": team or self.team,
            "api_app_id": "A1",
            "type": "event_callback",
            "event_id": event_id or f"Ev{next(self._event_ids):08d}",
            "event_time": int(time.time()),
            "event": event,
        }
        body = json.dumps(payload)
        headers = signed_headers(body, secret=self.secret)
        if retry is not None:
            headers["X-Slack-Retry-Num"] = str(retry)
            headers["X-Slack-Retry-Reason"] = "http_timeout"
        status, _ = await self.raw(body, headers)
        return status

    async def message(
        self,
        text: str,
        *,
        user: str = "U1",
        channel: str = "C1",
        ts: str | None = None,
        thread_ts: str | None = None,
        mention: bool = False,
        kind: str = "message",
        channel_type: str = "channel",
        retry: int | None = None,
        team: str | None = None,
        files: list[dict[str, Any]] | None = None,
    ) -> str:
        """A human message (``kind="app_mention"`` for the mention event); returns its ts."""
        ts = ts or self.new_ts()
        event: dict[str, Any] = {
            "type": kind,
            "user": user,
            "text": (f"<@{BOT_USER}> " if mention else "") + text,
            "ts": ts,
            "channel": channel,
            "event_ts": ts,
            "channel_type": channel_type,
            "team": team or self.team,
        }
        if thread_ts:
            event["thread_ts"] = thread_ts
        if files:
            event.update(subtype="file_share", files=files)
        status = await self.event(event, retry=retry, team=team)
        assert status == 200, status
        return ts

    async def stop_button(self, thread_ts: str, *, user: str = "U1", channel: str = "C1") -> int:
        """What Slack sends when someone clicks the stop button of the thread's agent session."""
        return await self.event(
            {
                "type": "agent_session_stopped",
                "channel": channel,
                "thread_ts": thread_ts,
                "user": user,
                "streaming_message_ts": [],
                "event_ts": self.new_ts(),
            }
        )

    async def interaction(self, payload: dict[str, Any]) -> int:
        body = urllib.parse.urlencode({"payload": json.dumps(payload)})
        return await self._signed(body, "application/x-www-form-urlencoded")

    async def shortcut(
        self,
        callback_id: str,
        *,
        message_ts: str,
        thread_ts: str | None,
        user: str = "U1",
        channel: str = "C1",
        team: str | None = None,
    ) -> int:
        message: dict[str, Any] = {"type": "message", "ts": message_ts, "text": "…"}
        if thread_ts:
            message["thread_ts"] = thread_ts
        return await self.interaction(
            {
                "type": "message_action",
                "callback_id": callback_id,
                "trigger_id": "trig",
                "team": {"id": team or self.team, "domain": "test"},
                "user": {"id": user, "team_id": team or self.team},
                "channel": {"id": channel, "name": "general"},
                "message": message,
                "message_ts": message_ts,
                "response_url": UNUSED_URL,
                "token": "legacy",
            }
        )

    async def button(
        self, action_id: str, value: str, *, user: str = "U1", channel: str = "C1"
    ) -> int:
        return await self.interaction(
            {
                "type": "block_actions",
                "team": {"id": self.team, "domain": "test"},
                "user": {"id": user, "team_id": self.team},
                "channel": {"id": channel},
                "container": {"type": "message", "channel_id": channel, "is_ephemeral": True},
                "trigger_id": "trig",
                "token": "legacy",
                "response_url": self.response_url,
                "actions": [
                    {"type": "button", "action_id": action_id, "value": value, "block_id": "b"}
                ],
            }
        )

    async def submit_view(self, view: dict[str, Any], *, user: str = "U1") -> int:
        """What Slack sends when a person presses a modal's submit button."""
        return await self.interaction(
            {
                "type": "view_submission",
                "team": {"id": self.team, "domain": "test"},
                "user": {"id": user, "team_id": self.team},
                "trigger_id": "trig",
                "view": {**view, "id": "V1", "state": {"values": {}}},
            }
        )

    async def command(
        self, command: str, text: str, *, user: str = "U1", channel: str = "C1"
    ) -> int:
        body = urllib.parse.urlencode(
            {
                "token": "legacy",
                "team_id": self.team,
                "team_domain": "test",
                "channel_id": channel,
                "user_id": user,
                "command": command,
                "text": text,
                "response_url": UNUSED_URL,
                "trigger_id": "trig",
            }
        )
        return await self._signed(body, "application/x-www-form-urlencoded")


if __name__ == "__main__":  # the stand-in in its own process (the benchmark's load generator
    # must not share an event loop with the server the bot calls back)
    run_forever(SlackStandIn(history=True))
