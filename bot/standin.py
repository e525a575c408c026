"""A local stand-in for the Slack Web API, for the demo, the benchmark and the soak.

A real HTTP server on 127.0.0.1 (``SLACK_API_URL`` points at it) that answers like Slack
(``ok: true``, fresh ``ts`` values, streaming methods included) and keeps what was posted, so the
demo can print a thread as a Slack user would see it. It is not a test double of Slack's rules.
With ``SlackFaults`` it answers a share of calls as an overloaded Slack does: 429 with
``Retry-After``, or 500 (the call is then not carried out); ``FaultSchedule`` spreads those
shares evenly over the calls. Also: ``signed`` builds the headers
Slack signs its requests with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TEAM = "T0DEMO"
BOT_USER = "U0AGENT"


class FaultSchedule:
    """Which fault, if any, the next request meets: each at exactly its share of the requests,
    spread evenly. A random draw per request made a short run meet no fault of a rare kind now
    and then (a 1 % fault over 200 requests is absent about one run in eight), so a run could
    not prove it recovered from it; here ``n`` requests meet ``round(n * share)`` of each kind,
    whatever order concurrent requests arrive in. Two faults due on one request: the second
    waits for the next."""

    def __init__(self, **shares: float) -> None:
        self._shares = {name: share for name, share in shares.items() if share > 0}
        self._credit = dict.fromkeys(self._shares, 0.5)

    def next(self) -> str | None:
        for name, share in self._shares.items():
            self._credit[name] += share
        for name, credit in self._credit.items():
            if credit >= 1:
                self._credit[name] = credit - 1
                return name
        return None


@dataclass(frozen=True)
class SlackFaults:
    rate_limited: float = 0.0  # share of calls answered 429 with Retry-After: 1
    server_error: float = 0.0  # share of calls answered 500


@dataclass
class Posted:
    """One message as a Slack client would show it (ephemerals only to ``visible_to``)."""

    ts: str
    channel: str
    thread_ts: str | None
    text: str
    visible_to: str | None = None
    author: str = "agent"
    buttons: list[str] = field(default_factory=list)
    values: list[str] = field(default_factory=list)
    streaming: bool = False  # a stream that was started and not (yet) stopped
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)  # task cards, by id

    def as_slack(self) -> dict[str, Any]:
        """The message as ``conversations.replies`` lists it."""
        who = {"bot_id": "B0AGENT", "user": BOT_USER} if self.author == "agent" else {}
        return {"ts": self.ts, "text": self.text, "user": self.author, **who}


def _shown_text(args: dict[str, Any]) -> str:
    """What a message's arguments show: Markdown as written, mrkdwn with its entities
    decoded, ``markdown`` blocks, and the text of ``markdown_text`` chunks."""
    markdown = [b for b in args.get("blocks") or [] if b.get("type") == "markdown"]
    if markdown:
        return "".join(str(b.get("text", "")) for b in markdown)
    if args.get("markdown_text"):
        text = str(args["markdown_text"])
    else:
        mrkdwn = str(args.get("text") or "")
        text = mrkdwn.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    chunks = args.get("chunks") or []
    return text + "".join(
        str(c.get("text", "")) for c in chunks if c.get("type") == "markdown_text"
    )


def _track_tasks(posted: Posted, args: dict[str, Any]) -> None:
    for chunk in args.get("chunks") or []:
        if chunk.get("type") == "task_update":
            posted.tasks[str(chunk["id"])] = {**posted.tasks.get(str(chunk["id"]), {}), **chunk}


class SlackStandIn:
    def __init__(self, team: str = TEAM, faults: SlackFaults | None = None) -> None:
        self.team = team
        self.faults = faults or SlackFaults()
        self.injected: Counter[str] = Counter()
        self._faults = FaultSchedule(
            rate_limited=self.faults.rate_limited, server_error=self.faults.server_error
        )
        self.url = ""
        self.posted: dict[str, Posted] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.views: list[dict[str, Any]] = []  # modals the app opened (views.open)
        self.changed = asyncio.Event()
        self._ts = itertools.count(1)
        self._runner: web.AppRunner | None = None

    @property
    def api_url(self) -> str:
        return self.url + "/api/"

    def next_ts(self) -> str:
        return f"{int(time.time())}.{next(self._ts):06d}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/api/{method}", self._handle)
        app.router.add_get("/api/{method}", self._handle)  # slack_sdk reads some with GET
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        if request.method == "GET":
            args: dict[str, Any] = dict(request.query)
        elif request.content_type == "application/json":
            args = dict(await request.json())
        else:
            args = {k: str(v) for k, v in (await request.post()).items()}
        for key in ("blocks", "view", "chunks"):
            if isinstance(args.get(key), str):
                args[key] = json.loads(args[key])
        fault = self._faults.next()
        if fault == "rate_limited":
            self.injected["429"] += 1
            return web.json_response(
                {"ok": False, "error": "ratelimited"}, status=429, headers={"Retry-After": "1"}
            )
        if fault == "server_error":
            self.injected["500"] += 1
            return web.json_response({"ok": False, "error": "fatal_error"}, status=500)
        self.calls.append((method, args))
        result = self._answer(method, args)
        self.changed.set()
        return web.json_response(result)

    def _answer(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        channel = str(args.get("channel") or args.get("channel_id") or "")
        text = _shown_text(args)
        if method == "auth.test":
            return {
                "ok": True,
                "team_id": self.team,
                "user_id": BOT_USER,
                "bot_id": "B0AGENT",
                "team": "Demo",
                "user": "agent",
                "url": "https://demo.slack.com/",
            }
        if method in ("chat.postMessage", "chat.startStream", "chat.postEphemeral"):
            ts = self.next_ts()
            posted = Posted(ts, channel, args.get("thread_ts"), text)
            posted.streaming = method == "chat.startStream"
            _track_tasks(posted, args)
            if method == "chat.postEphemeral":
                posted.visible_to = str(args.get("user"))
                for block in args.get("blocks") or []:
                    for element in block.get("elements", []):
                        if element.get("type") == "button":
                            posted.buttons.append(str(element["text"]["text"]))
                            posted.values.append(
                                f"{element['action_id']}\x00{element.get('value', '')}"
                            )
            self.posted[ts] = posted
            if method == "chat.postEphemeral":
                return {"ok": True, "message_ts": ts}
            return {"ok": True, "channel": channel, "ts": ts, "message": {"ts": ts}}
        if method in ("chat.update", "chat.appendStream", "chat.stopStream"):
            ts = str(args.get("ts"))
            found = self.posted.get(ts)
            if method != "chat.update" and found is not None and not found.streaming:
                return {"ok": False, "error": "message_not_in_streaming_state"}
            if found is not None:
                found.text = text if method == "chat.update" else found.text + text
                _track_tasks(found, args)
                found.streaming = found.streaming and method != "chat.stopStream"
            return {"ok": True, "channel": channel, "ts": ts}
        if method == "views.open":
            self.views.append(dict(args.get("view") or {}))
            return {"ok": True, "view": {"id": f"V{len(self.views)}"}}
        if method == "conversations.replies":
            root, oldest = str(args.get("ts")), str(args.get("oldest") or "0")
            shown = [p for p in self.thread(channel, root) if p.ts >= oldest]
            return {"ok": True, "messages": [p.as_slack() for p in shown]}
        if method == "chat.delete":
            self.posted.pop(str(args.get("ts")), None)
        return {"ok": True}

    def user_post(self, channel: str, user: str, text: str, thread_ts: str | None) -> str:
        """A person's message, as Slack would store it (the app hears it as an event)."""
        ts = self.next_ts()
        self.posted[ts] = Posted(ts, channel, thread_ts, text, author=user)
        return ts

    def thread(self, channel: str, root: str, viewer: str | None = None) -> list[Posted]:
        """The thread's messages in order, as ``viewer`` sees them (their ephemerals too)."""
        return sorted(
            (
                p
                for p in self.posted.values()
                if p.channel == channel
                and (p.thread_ts == root or p.ts == root)
                and (p.visible_to is None or p.visible_to == viewer)
            ),
            key=lambda p: p.ts,
        )


def signed(body: str, secret: str, timestamp: int | None = None) -> dict[str, str]:
    """The headers Slack sends with a request: timestamp and v0 HMAC-SHA256 signature."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    digest = hmac.new(secret.encode(), f"v0:{ts}:{body}".encode(), hashlib.sha256).hexdigest()
    return {
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": f"v0={digest}",
        "Content-Type": "application/json",
    }


async def _serve_forever() -> None:
    standin = SlackStandIn()
    await standin.start()
    print(standin.api_url, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await standin.stop()


if __name__ == "__main__":  # a stand-in in its own process (the benchmark's load generator
    # must not share an event loop with the server the bot calls back)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever())
