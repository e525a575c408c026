"""A forward HTTP proxy on 127.0.0.1 for plain-HTTP targets: what a client told to use
``HTTP_PROXY`` sends (a request with its absolute URL as the target), forwarded to that URL's
server, and the answer relayed back as it arrives (a model's stream too). One request per
connection, as a client may always be told (``Connection: close``). ``forwarded`` lists the
URLs it carried, so a test can say whether a request went through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

from standins.listener import ProxyListener

# Headers for this hop only (RFC 9110, 7.6.1), not sent on to the server.
_HOP: frozenset[str] = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "upgrade"}
)


class HttpProxy(ProxyListener):
    def __init__(self) -> None:
        super().__init__()
        self.forwarded: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *lines = head.split("\r\n")
            method, target, version = request_line.split(" ", 2)
            url = urlsplit(target)
            if url.scheme != "http" or url.hostname is None:
                writer.write(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n")
                return
            kept, length = [], 0
            for line in filter(None, lines):
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
                if name.strip().lower() not in _HOP:
                    kept.append(line + "\r\n")
            body = await reader.readexactly(length)
            self.forwarded.append(target)
            up_reader, up_writer = await asyncio.open_connection(url.hostname, url.port or 80)
            try:
                path = url.path + (f"?{url.query}" if url.query else "")
                sent = f"{method} {path or '/'} {version}\r\n{''.join(kept)}"
                up_writer.write(f"{sent}Connection: close\r\n\r\n".encode("latin-1") + body)
                await up_writer.drain()
                while chunk := await up_reader.read(2**16):
                    writer.write(chunk)
                    await writer.drain()
            finally:
                up_writer.close()
        except (OSError, asyncio.IncompleteReadError, ValueError):
            pass  # the client or the server went away: so does this connection
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
