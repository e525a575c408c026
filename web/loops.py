"""Crossing from the listener's event loop to the turns' loop, and back for a stream.

``serve`` runs the listener on the intake's thread and loop so that Slack's acknowledgements
never wait behind turn work; a session's turn and every call of the conversation API run on
the turns' loop, where its database engine lives. ``TurnsLoop.run`` awaits work there;
``TurnsLoop.start`` starts a turn there without tying it to the request (a client that goes
away does not stop its turn). A turn's renderer writes to a ``Pipe``, which hands each chunk
to the request's loop thread-safely; on one loop (tests, the demo) the same calls work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

T = TypeVar("T")

OPENED: Final = b""  # the turn began: the response may open (never a chunk: chunks are events)


class Ended:
    """The turn is over (its future holds how)."""


ENDED: Final = Ended()


class TurnsLoop:
    """The loop that owns the conversation API (made on it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()

    async def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """``make()`` awaited on the turns' loop, its result here."""
        if asyncio.get_running_loop() is self.loop:
            return await make()

        async def there() -> T:
            return await make()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(there(), self.loop))

    def start(self, make: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """``make()`` started on the turns' loop; it runs to its end whatever the caller does."""

        async def there() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(there(), self.loop)


class Pipe:
    """Chunks from a turn's renderer (any loop) to the request that streams them (its loop).

    Unbounded: an answer is a few hundred kilobytes at most, and the turn must never wait on a
    slow client (a client gone is never read: the chunks are dropped with the pipe)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes | Ended] = asyncio.Queue()

    def open(self) -> None:
        self._put(OPENED)

    def write(self, data: bytes) -> None:
        if data:
            self._put(data)

    def end(self) -> None:
        self._put(ENDED)

    async def get(self) -> bytes | Ended:
        return await self._queue.get()

    def _put(self, item: bytes | Ended) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the request's loop is closed (a stopping process): nobody reads
            return
