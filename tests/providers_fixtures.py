"""A scripted HTTP server on 127.0.0.1 for provider tests: replies from a queue, requests recorded.

The fakes of each wire format (``fake_openai``, ``fake_anthropic``) build replies for it; the
server only knows how to send them, including the faults: a status with headers, a stream that
stalls, a stream whose connection is dropped mid-body, a request that is never answered.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from aiohttp import web

from core.providers import ChatMessage, ModelProvider, StreamEvent, TextDelta, ToolSpec


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any


class Reply(Protocol):
    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse: ...


@dataclass(frozen=True)
class JsonReply:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse:
        return web.json_response(self.body, status=self.status, headers=dict(self.headers))


@dataclass(frozen=True)
class SseReply:
    """SSE frames, each written in two pieces so the client must reassemble lines.

    ``stall``: after the frames, say nothing more until the server closes (a read timeout).
    ``cut``: after the frames, drop the connection in the middle of the chunked body.
    """

    frames: Sequence[str]
    stall: bool = False
    cut: bool = False

    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        for frame in self.frames:
            raw = frame.encode()
            half = len(raw) // 2
            await response.write(raw[:half])
            await response.write(raw[half:])
        if self.stall:
            await server.closing.wait()
        if self.cut:
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write_eof()
        return response


@dataclass(frozen=True)
class Silence:
    """Take the request and answer nothing, not even headers, until the server closes."""

    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse:
        await server.closing.wait()
        return web.Response(status=503)


def sse_frame(data: Any, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class ScriptedServer:
    """Answers each request with the next scripted reply; 500 once the script runs out."""

    def __init__(self) -> None:
        self.script: deque[Reply] = deque()
        self.requests: list[RecordedRequest] = []
        self.closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def push(self, *replies: Reply) -> None:
        self.script.extend(replies)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.requests.append(
            RecordedRequest(
                request.method,
                request.path,
                {name.lower(): value for name, value in request.headers.items()},
                json.loads(raw) if raw else None,
            )
        )
        if not self.script:
            return web.json_response({"error": {"message": "script exhausted"}}, status=500)
        return await self.script.popleft().send(request, self)

    async def __aenter__(self) -> ScriptedServer:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.closing.set()
        assert self._runner is not None
        await self._runner.cleanup()


class RecordingSleep:
    """The retry policy's sleep: records each wait instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


async def collect(
    provider: ModelProvider,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] = (),
    **options: Any,
) -> list[StreamEvent]:
    return [event async for event in provider.stream(messages, tools, **options)]


def text_of(events: Sequence[StreamEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))
