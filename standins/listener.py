"""A TCP server on 127.0.0.1, on a port of its own, used as an async context manager: what the
tests' proxies (``tcp_proxy``, ``http_proxy``) share. A subclass serves each connection
(``_serve``) and ends its own connections before the listener closes (``close``)."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Self


class ProxyListener:
    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening (a subclass ends its connections first, then calls this)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
