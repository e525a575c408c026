"""A TCP proxy on 127.0.0.1 between processes and a server (PostgreSQL) that can fail two ways,
without stopping a server others share:

- ``cut``: every connection is closed and new ones refused (the database went away, and the
  processes behind the proxy are told at once);
- ``blackhole``: nothing is forwarded any more, in either direction, and nothing is closed: a
  network partition, a failover whose old address went silent, a half-open connection. What
  was sent waits (as the kernel's buffers would while TCP retransmits) and flows again, in
  order, after ``restore``; a new connection is accepted and then hears nothing. A process
  behind the proxy finds out only through its own timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from standins.listener import ProxyListener


class TcpProxy(ProxyListener):
    def __init__(self, target_host: str, target_port: int) -> None:
        super().__init__()
        self.target = (target_host, target_port)
        self.up = True
        self.blackholed_at: float | None = None  # time.monotonic() of the last blackhole
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()
        # Each new connection waits this long before it reaches the server (a slow network or a
        # loaded server: what opening a connection costs).
        self.opening_delay = 0.0

    async def close(self) -> None:
        self.cut()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        await super().close()

    def cut(self) -> None:
        """Close every connection and refuse new ones until ``restore``."""
        self.up = False
        self._flowing.set()  # pipes waiting in a blackhole see their connection closed
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def blackhole(self) -> None:
        """Stop forwarding, closing nothing, until ``restore``."""
        self.blackholed_at = time.monotonic()
        self._flowing.clear()

    def restore(self) -> None:
        self.up = True
        self._flowing.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._pipes.add(task)
        try:
            await self._flowing.wait()
            if not self.up:
                writer.close()
                return
            if self.opening_delay:
                self._writers.add(writer)  # closed by ``cut`` (and ``close``) meanwhile
                await asyncio.sleep(self.opening_delay)
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.close()
                return
            self._writers |= {writer, up_writer}
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        finally:
            if task is not None:
                self._pipes.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # read just as the hole opened: held until restored
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()
