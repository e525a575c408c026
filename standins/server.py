"""What every stand-in server shares: an aiohttp app on 127.0.0.1 at a free port.

A stand-in is a real HTTP server so the product talks to it exactly as it talks to the real
service (its own HTTP client, its own timeouts, its own connection pool); ``LocalServer`` is
the one place that starts, stops and names such a server. ``serve_app`` serves any app the same
way (the product's own web app, in tests and in the demo). ``run_forever`` runs a stand-in in a
process of its own and prints its URL (``standins.processes.spawn`` starts one): the
benchmark's load generator must not share an event loop with the servers the app calls back.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self

from aiohttp import web

HOST = "127.0.0.1"


async def serve_app(
    app: web.Application, *, backlog: int = 128, shutdown_timeout: float = 1.0
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on a free local port; the runner (``cleanup()`` stops it) and its URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0, backlog=backlog)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://{HOST}:{port}"


class LocalServer:
    """A stand-in server: ``async with`` it (or ``start``/``stop``), then point the product at
    ``url``. Subclasses add their routes; ``release`` lets go whatever the server holds back
    (gated answers, hanging requests) so that stopping never waits on a test's gate."""

    client_max_size = 64 << 20  # a long conversation's request is large
    backlog = 128
    shutdown_timeout = 1.0

    def __init__(self) -> None:
        self.url = ""
        self._runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def release(self) -> None:
        """Let anything held back go (called before the server stops)."""

    async def start(self) -> None:
        app = web.Application(client_max_size=self.client_max_size)
        self.routes(app)
        self._runner, self.url = await serve_app(
            app, backlog=self.backlog, shutdown_timeout=self.shutdown_timeout
        )

    async def stop(self) -> None:
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()


async def serve_forever(server: LocalServer) -> None:
    """Run ``server`` until interrupted, after printing its URL (the parent reads that line)."""
    await server.start()
    print(server.url, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


def run_forever(server: LocalServer) -> None:
    """``python -m standins.X``: ``serve_forever`` until interrupted."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(server))
