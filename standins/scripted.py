"""A model stand-in's server: requests recorded, each answered by a reply object.

The wire formats (``standins.openai``, ``standins.anthropic``) build the replies; the
server only knows how to send them, with the hooks a test or a benchmark needs around a real
model: a queue of scripted replies (``push``) or a function choosing each reply (``respond``);
requests in flight counted overall and per conversation (``key``), so "never two model calls at
once for one session" is checked where the calls arrive; answers a client walked away from
counted (``dropped``). The replies carry the faults and the timing: a status with headers, a
stream that is slow (``pauses``), waits at a gate the test opens (``gate``), stalls, is cut
mid-body, or a request never answered at all.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from standins.server import LocalServer


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: Any


@dataclass
class Span:
    """One request's time in flight (``time.monotonic``), and who sent it. ``end``: when its
    answer ended or its client was seen gone; ``request`` while in flight."""

    number: int
    start: float
    end: float | None
    sender: str
    request: web.Request | None = field(default=None, repr=False)

    def hung_up(self) -> bool:
        """Its client closed the connection (this server read the end of it)."""
        transport = None if self.request is None else self.request.transport
        return transport is None or transport.is_closing()


class Reply(Protocol):
    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse: ...


@dataclass(frozen=True)
class JsonReply:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)

    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse:
        return web.json_response(self.body, status=self.status, headers=dict(self.headers))


async def pause(request: web.Request, seconds: float) -> None:
    """Sleep, but stop when the client hangs up: a call the product gave up on (a model
    timeout) or whose process died is no longer in flight, whatever the server would do next."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client went away")
        await asyncio.sleep(min(left, 0.02))


@dataclass(frozen=True)
class SseReply:
    """SSE frames, as a model streams them.

    ``split``: each frame written in two pieces, so the client must reassemble lines.
    ``pauses``: seconds to wait before the frame of that index (the model thinking, a slow
    stream), watching for the client to hang up. ``gate``: before frame ``gate_at``, wait until
    the event is set (``arrived`` is set when the stream gets there). ``linger``: after the
    frames, seconds of silence before the end. ``stall``: after the frames, say nothing more
    until the server closes (a read timeout). ``cut``: after the frames, drop the connection in
    the middle of the chunked body.
    """

    frames: Sequence[str]
    stall: bool = False
    cut: bool = False
    split: bool = True
    pauses: Mapping[int, float] = field(default_factory=dict)
    gate: asyncio.Event | None = None
    gate_at: int = 0
    arrived: asyncio.Event | None = None
    linger: float = 0.0

    async def send(self, request: web.Request, server: ScriptedServer) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        for number, frame in enumerate(self.frames):
            if number == self.gate_at and self.gate is not None:
                if self.arrived is not None:
                    self.arrived.set()
                await self.gate.wait()
            if self.pauses.get(number):
                await pause(request, self.pauses[number])
            raw = frame.encode()
            if self.split:
                half = len(raw) // 2
                await response.write(raw[:half])
                await response.write(raw[half:])
            else:
                await response.write(raw)
        if self.linger:
            await pause(request, self.linger)
            return response
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


Respond = Callable[[RecordedRequest, int], Reply]


class ScriptedServer(LocalServer):
    """Answers each request with ``respond(request, number)`` if set, else with the next
    scripted reply (500 once the script runs out). ``record=False`` keeps no request bodies
    (a soak sends thousands of long conversations)."""

    path = "/{tail:.*}"

    def __init__(
        self,
        respond: Respond | None = None,
        *,
        key: Callable[[Any], str] | None = None,
        record: bool = True,
    ) -> None:
        super().__init__()
        self.respond = respond
        self.key = key or (lambda body: "")
        self.record = record
        self.script: deque[Reply] = deque()
        self.requests: list[RecordedRequest] = []
        self.count = 0  # requests taken, recorded or not
        # Per key, each request's span: when it came and ended (``time.monotonic``; None while
        # in flight), and who sent it (its ``authorization`` header): ``overlaps`` says which,
        # and the counts in flight are read from them.
        self.spans_by: dict[str, list[Span]] = defaultdict(list)
        self.finished = 0
        self.dropped = 0  # answers the client no longer took (it stopped, timed out or died)
        self.closing = asyncio.Event()

    def push(self, *replies: Reply) -> None:
        self.script.extend(replies)

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", self.path, self._handle)

    def release(self) -> None:
        self.closing.set()

    async def start(self) -> None:
        self.closing = asyncio.Event()
        await super().start()

    @property
    def in_flight(self) -> int:
        """Requests in flight now."""
        return sum(1 for spans in self.spans_by.values() for span in spans if span.end is None)

    @property
    def max_in_flight(self) -> int:
        """The most requests there ever were in flight at once."""
        return _most_at_once([span for spans in self.spans_by.values() for span in spans])

    def overlapping(self) -> dict[str, int]:
        """Keys that ever had two requests in flight at once, and the most there were."""
        most = {key: _most_at_once(spans) for key, spans in self.spans_by.items()}
        return {key: n for key, n in most.items() if n > 1}

    def overlaps(self, key: str) -> list[tuple[Span, Span]]:
        """The pairs of ``key``'s requests that were in flight at once."""
        spans = sorted(self.spans_by.get(key, []), key=lambda span: span.start)
        return [
            (a, b)
            for i, a in enumerate(spans)
            for b in spans[i + 1 :]
            if a.end is None or b.start < a.end
        ]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        recorded = RecordedRequest(
            request.method,
            request.path,
            {name.lower(): value for name, value in request.headers.items()},
            json.loads(raw) if raw else None,
        )
        self.count += 1
        number = self.count
        if self.record:
            self.requests.append(recorded)
        if self.respond is not None:
            reply = self.respond(recorded, number)
        elif self.script:
            reply = self.script.popleft()
        else:
            return web.json_response({"error": {"message": "script exhausted"}}, status=500)
        key = self.key(recorded.body)
        now = time.monotonic()
        for earlier in self.spans_by[key]:
            if earlier.end is None and earlier.hung_up():
                # Its client left before this request came (the connection's end was read
                # before this request's bytes, sent after it): only the answer's next pause
                # would notice, up to 20 ms on, and count the two at once.
                earlier.end = now
        span = Span(number, now, None, recorded.headers.get("authorization", ""), request)
        self.spans_by[key].append(span)
        try:
            response = await reply.send(request, self)
            self.finished += 1
            return response
        except ConnectionError:
            self.dropped += 1
            return web.StreamResponse()
        except asyncio.CancelledError:
            self.dropped += 1
            raise
        finally:
            if span.end is None:  # not already ended by a later request of its key
                span.end = time.monotonic()
            span.request = None


def _most_at_once(spans: Sequence[Span]) -> int:
    """The most of ``spans`` in flight at one moment (one that ends as another starts does not
    overlap it; one still in flight has not ended)."""
    moments = sorted(
        [(span.start, 1) for span in spans]
        + [(span.end, -1) for span in spans if span.end is not None]
    )
    most = now = 0
    for _, step in moments:
        now += step
        most = max(most, now)
    return most
