"""Server-sent events from a stream of lines, as both model APIs send them.

Only ``event`` and ``data`` matter to us; ``id`` and ``retry`` are for browsers reconnecting.
An event still open when the stream ends is dropped, as the SSE spec says: whether the stream
was complete is the provider's call (each API has its own terminator), not the parser's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSentEvent:
    event: str | None
    data: str


async def iter_sse(lines: AsyncIterable[str]) -> AsyncGenerator[ServerSentEvent, None]:
    event: str | None = None
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield ServerSentEvent(event, "\n".join(data))
            event, data = None, []
            continue
        if line.startswith(":"):  # a comment: servers send these as keep-alives
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
