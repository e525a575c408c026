"""Stand-ins for what the bot talks to, as real HTTP servers on 127.0.0.1.

``FakeSlack``: the Slack Web API (``SLACK_API_URL`` points at it). It records every call
(method and decoded arguments) and answers like Slack: ``ok: true`` with fresh ``ts`` values.
``streaming=False`` makes ``chat.startStream`` fail as in a workspace without streaming.

``GatedModel``: an OpenAI-compatible Chat Completions server whose answers wait for the test to
open a gate, counting requests in flight, so tests can hold a turn open (busy) and check that a
session never has two model calls at once.

Slack's rules the stand-in keeps: one ``markdown_text`` holds at most 12,000 characters and a
message at most 40,000 (``msg_too_long`` otherwise; a longer mrkdwn ``text`` is cut, as Slack
does); a stopped stream answers ``message_not_in_streaming_state``. It keeps each message as a
person would read it (``Shown``: mrkdwn entities decoded, Markdown as written, task cards,
blocks) and every Slack control sequence that reached a field Slack would act on
(``controls``).

``SlackClient``: sends correctly signed requests (v0 signature, ``X-Slack-Request-Timestamp``)
to a running bot, the way Slack does.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web

from tests.fake_openai import DONE, text_frames, tool_call_frames, usage_chunk
from tests.providers_fixtures import sse_frame

MARKDOWN_LIMIT = 12_000
MESSAGE_LIMIT = 40_000
# What Slack acts on in a message: mentions, channel links, special mentions, labelled links.
CONTROL = re.compile(r"<(?:[!@#][^>\s]*|[A-Za-z][A-Za-z0-9+.\-]*:[^>|\s]*\|[^>]*)>")

TEAM = "T1"
BOT_USER = "UBOT"
BOT_ID = "BBOT"
SIGNING_SECRET = "test-signing-secret"
_MESSAGE_TS = itertools.count(1)


@dataclass(frozen=True)
class Call:
    method: str
    args: dict[str, Any]
    result: dict[str, Any]

    @property
    def text(self) -> str:
        return str(self.args.get("text") or self.args.get("markdown_text") or "")


@dataclass
class Shown:
    """One message of the app as a person reads it."""

    ts: str
    thread_ts: str | None
    text: str = ""
    streaming: bool = False
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # task cards by id
    blocks: list[dict[str, Any]] = field(default_factory=list)


def _unescape(mrkdwn: str) -> str:
    return mrkdwn.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


class _Server:
    def __init__(self) -> None:
        self.url = ""
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> _Server:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._runner is not None
        self.release()
        for ws in getattr(self, "sockets", []):
            await ws.close()
        await self._runner.cleanup()

    def release(self) -> None:
        """Let anything the server holds back go (before it stops)."""
        for held in getattr(self, "hold", {}).values():
            held.set()


class FakeSlack(_Server):
    def __init__(self, *, streaming: bool = True, team: str = TEAM) -> None:
        super().__init__()
        self.streaming = streaming
        self.team = team
        self.calls: list[Call] = []
        self.rate_limit_once: set[str] = set()  # methods answered 429 once, then normally
        # Faults, per method: HTTP statuses to answer before answering normally (0 drops the
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
        # What conversations.replies answers, by thread ts.
        self.threads: dict[str, list[dict[str, Any]]] = {}
        self.responses: list[dict[str, Any]] = []  # what the app sent to response_urls
        # Awaited with each call's method and arguments before it is answered (a test acting
        # while the app waits on a call).
        self.intercept: Callable[[str, dict[str, Any]], Awaitable[None]] | None = None
        self.shown_messages: dict[str, Shown] = {}  # the app's messages, by ts
        self.controls: list[str] = []  # control sequences that reached a field Slack acts on
        self.sockets: list[web.WebSocketResponse] = []
        self.socket_acks: list[dict[str, Any]] = []
        self._changed = asyncio.Event()
        self._ts = itertools.count(1)

    @property
    def api_url(self) -> str:
        return self.url + "/api/"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/api/{method}", self._handle)
        app.router.add_get("/api/{method}", self._handle)
        app.router.add_get("/socket", self._socket)
        app.router.add_get("/files/{name}", self._file)
        app.router.add_post("/response/{key}", self._response)

    # -- Socket Mode: apps.connections.open hands out this server's WebSocket ------------------

    async def _socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.append(ws)
        await ws.send_json({"type": "hello", "num_connections": 1, "debug_info": {}})
        self._changed.set()
        async for frame in ws:
            if frame.type == aiohttp.WSMsgType.TEXT:
                self.socket_acks.append(json.loads(frame.data))
                self._changed.set()
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
        self._changed.set()
        return web.Response(text="ok")

    def file_url(self, name: str) -> str:
        return f"{self.url}/files/{name}"

    async def _file(self, request: web.Request) -> web.Response:
        found = self.files.get(request.match_info["name"])
        if found is None:
            return web.Response(status=404)
        if request.headers.get("Authorization") != "Bearer xoxb-test":
            login = "<!DOCTYPE html><html><body>Sign in to Slack</body></html>"
            return web.Response(text=login, content_type="text/html")
        data, content_type = found
        return web.Response(body=data, content_type=content_type)

    def next_ts(self) -> str:
        return f"1800000000.{next(self._ts):06d}"

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        if request.method == "GET":
            args = dict(request.query)
        elif request.content_type == "application/json":
            args = dict(await request.json())
        else:  # slack_sdk sends some methods' arguments in the query string (chat.delete)
            args = {**request.query, **dict(await request.post())}
        for key in ("blocks", "metadata", "view"):
            if isinstance(args.get(key), str):
                args[key] = json.loads(args[key])
        if self.intercept is not None:
            await self.intercept(method, args)
        statuses = self.fail_next.get(method)
        if statuses:
            status = statuses.pop(0)
            self.calls.append(Call(method, args, {"ok": False, "error": f"http_{status}"}))
            self._changed.set()
            if status == 0:
                assert request.transport is not None
                request.transport.close()
                return web.Response(status=500)
            return web.json_response({"ok": False, "error": "fatal_error"}, status=status)
        if method in self.errors:
            failed = {"ok": False, "error": self.errors[method]}
            self.calls.append(Call(method, args, failed))
            self._changed.set()
            return web.json_response(failed)
        if method in self.rate_limit_once:
            self.rate_limit_once.discard(method)
            self.calls.append(Call(method, args, {"ok": False, "error": "ratelimited"}))
            return web.json_response(
                {"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": "1"}
            )
        result = self._limits(method, args) or self._answer(method, args)
        if result.get("ok"):
            self._keep(method, args, result)
        self.calls.append(Call(method, args, result))
        self._changed.set()
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
            if args.get("ts") in self.stopped_streams:
                return {"ok": False, "error": "message_not_in_streaming_state"}
            if method == "chat.stopStream":
                self.stopped_streams.add(str(args.get("ts")))
        if method in ("chat.update", "chat.appendStream", "chat.stopStream"):
            return {"ok": True, "channel": channel, "ts": args.get("ts")}
        if method == "chat.postEphemeral":
            return {"ok": True, "message_ts": self.next_ts()}
        if method == "views.open":
            return {"ok": True, "view": {"id": f"V{self.next_ts()}"}}
        if method == "conversations.replies":
            return self._replies(args)
        return {"ok": True}

    def _replies(self, args: dict[str, Any]) -> dict[str, Any]:
        """conversations.replies as Slack pages it: oldest first within ``oldest``/``latest``
        (``inclusive`` or not), ``limit`` at a time (1000 by default), an opaque cursor to go on."""
        inclusive = str(args.get("inclusive", "")).lower() in ("1", "true")
        oldest, latest = args.get("oldest"), args.get("latest")
        found = sorted(self.threads.get(str(args.get("ts")), []), key=lambda m: float(m["ts"]))
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
        if not method.startswith("chat."):
            return None
        pieces = [str(args.get("markdown_text") or "")]
        pieces += [
            str(c.get("text") or "") for c in args.get("chunks") or [] if isinstance(c, dict)
        ]
        if any(len(p) > MARKDOWN_LIMIT for p in pieces):
            return {"ok": False, "error": "msg_too_long"}
        found = self.shown_messages.get(str(args.get("ts")))
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
        chunks = [c for c in args.get("chunks") or [] if isinstance(c, dict)]
        for chunk in chunks:
            for key in ("text", "title", "output"):
                self.controls += CONTROL.findall(str(chunk.get(key) or ""))
        if method in ("chat.postMessage", "chat.startStream"):
            ts = str(result["ts"])
            self.shown_messages[ts] = Shown(
                ts, args.get("thread_ts"), streaming=method == "chat.startStream"
            )
        found = self.shown_messages.get(str(args.get("ts") or result.get("ts")))
        if found is None:
            return
        added = str(args.get("markdown_text") or "")
        if "text" in args and "markdown_text" not in args:
            added = _unescape(str(args["text"]))[:MESSAGE_LIMIT]
        added += "".join(
            str(c.get("text") or "") for c in chunks if c.get("type") == "markdown_text"
        )
        if method == "chat.update":
            found.text = added
            markdown = [b for b in args.get("blocks") or [] if b.get("type") == "markdown"]
            if markdown:
                found.text = "".join(str(b["text"]) for b in markdown)
        else:
            found.text += added
        for chunk in chunks:
            if chunk.get("type") == "task_update":
                found.tasks[str(chunk["id"])] = {**found.tasks.get(str(chunk["id"]), {}), **chunk}
        if args.get("blocks"):
            found.blocks = list(args["blocks"])
        if method == "chat.stopStream":
            found.streaming = False

    def thread_messages(self, thread_ts: str) -> list[Shown]:
        """The app's messages in a thread, oldest first, as a person reads them."""
        return [m for m in self.shown_messages.values() if m.thread_ts == thread_ts]

    # -- what tests look at ---------------------------------------------------------------------

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
                or (
                    c.method in ("chat.appendStream", "chat.stopStream", "chat.update")
                    and str(c.args.get("ts")) in ours
                )
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
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.25))


class GatedModel(_Server):
    """Answers "answer N" (N counting from 1) once the gate is open; records concurrency.

    ``command``: a request whose conversation does not end in a tool result is answered at once
    with a call of the ``shell`` tool running it (so a turn changes its sandbox, then waits at
    the gate for its final answer). ``dropped`` counts answers the client no longer took (it
    stopped the turn and closed the connection).
    """

    def __init__(self, *, early: str = "", command: str | None = None) -> None:
        super().__init__()
        self.early = early  # text streamed before waiting at the gate
        self.command = command
        self.gate = asyncio.Event()
        self.arrived = asyncio.Event()
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.dropped = 0

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def release(self) -> None:
        self.gate.set()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._handle)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        number = self.requests
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        try:
            await response.prepare(request)
            if self.command and body["messages"][-1].get("role") != "tool":
                calls = [(f"call_{number}", "shell", {"command": self.command})]
                for frame in [*tool_call_frames(calls), sse_frame(usage_chunk(5, 2)), DONE]:
                    await response.write(frame.encode())
                await response.write_eof()
                return response
            frames = (
                text_frames(self.early, f"answer {number}")
                if self.early
                else text_frames(f"answer {number}")
            )
            cut = 2 if self.early else 1
            head, tail = frames[:cut], frames[cut:]
            for frame in head:
                await response.write(frame.encode())
            self.arrived.set()
            await self.gate.wait()
            for frame in [*tail, sse_frame(usage_chunk(5, 2)), DONE]:
                await response.write(frame.encode())
            await response.write_eof()
            return response
        except ConnectionError:  # the client went away (a stopped turn)
            self.dropped += 1
            return response
        finally:
            self.in_flight -= 1


def signed_headers(
    body: str, *, secret: str = SIGNING_SECRET, timestamp: int | None = None
) -> dict[str, str]:
    ts = str(int(time.time()) if timestamp is None else timestamp)
    base = f"v0:{ts}:{body}".encode()
    signature = "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": signature}


class SlackClient:
    """Sends what Slack sends, signed, to ``{url}/slack/events``."""

    def __init__(self, url: str, *, team: str = TEAM, response_url: str | None = None) -> None:
        self.url = url.rstrip("/") + "/slack/events"
        self.team = team
        self.response_url = response_url or "http://127.0.0.1:1/unused"
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
        return f"1700000000.{next(_MESSAGE_TS):06d}"

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
        headers = signed_headers(body)
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
        status, _ = await self.raw(body, signed_headers(body), "application/x-www-form-urlencoded")
        return status

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
                "response_url": "http://127.0.0.1:1/unused",
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
                "response_url": "http://127.0.0.1:1/unused",
                "trigger_id": "trig",
            }
        )
        status, _ = await self.raw(body, signed_headers(body), "application/x-www-form-urlencoded")
        return status


async def rewind(
    client: SlackClient, slack: FakeSlack, *, message_ts: str, thread_ts: str, user: str = "U1"
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
