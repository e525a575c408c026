"""An HTTP transport that stops reading a response body past a bound, before anything parses it.

The MCP SDK reads a JSON answer of Streamable HTTP whole (``response.aread()``) and parses it
on the event loop, with no limit (its SSE events have one, which ``Connection`` sets to the same
bound). A response hook of the client wraps the body of a response that is not an event stream
so that reading it ends once it passes ``limit`` bytes (at once when its ``Content-Length``
says it will), with a ``httpx2.StreamError`` the SDK turns into a JSON-RPC error for that
request, whose text names the limit (``core.tools.stdio.too_large``). Imported only when an
HTTP server connects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2

from core.tools.stdio import too_large


def bound_responses(limit: int) -> Callable[[httpx2.Response], Awaitable[None]]:
    """An httpx response hook (``event_hooks={"response": [...]}``): it runs before the body is
    read, on every transport the client uses (proxies from the environment included)."""

    async def bound(response: httpx2.Response) -> None:
        kind = response.headers.get("content-type", "").lower()
        if kind.startswith("text/event-stream"):
            return  # bounded per event by the SDK (max_sse_event_size)
        stream = response.stream
        assert isinstance(stream, httpx2.AsyncByteStream)
        response.stream = _Bounded(stream, limit, response.headers.get("content-length"))

    return bound


class _Bounded(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, length: str | None) -> None:
        self._inner = inner
        self._limit = limit
        self._length = int(length) if length and length.isdigit() else None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._length is not None and self._length > self._limit:
            raise httpx2.StreamError(too_large(self._limit))
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._limit:
                raise httpx2.StreamError(too_large(self._limit))
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()
