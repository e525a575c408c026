"""The CPU a client spends reading a streamed model answer: httpx (what the providers used)
against aiohttp (what they use now), on the same server and the same answers.

A server process streams ``CHUNKS`` SSE frames, each written on its own 20 ms apart (as a
model sends tokens), to ``STREAMS`` requests at once; this process reads every line of every
answer and reports its own CPU (``time.process_time``) per answer, for each client twice,
alternating::

    uv run slack-agent bench stream-client
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Awaitable, Callable
from typing import Final

import aiohttp
import httpx
from aiohttp import web

from standins.processes import free_port

CHUNKS: Final = 24
STREAMS: Final = 200
FRAME: Final = b'data: {"choices":[{"delta":{"content":"word "}}]}\n\n'


def _serve(port: int) -> None:
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(CHUNKS - 1):
            await response.write(FRAME)
            await asyncio.sleep(0.02)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def _with_httpx(url: str) -> float:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2 * STREAMS)) as client:

        async def one() -> None:
            async with client.stream("POST", url, json={"stream": True}) as response:
                async for _ in response.aiter_lines():
                    pass

        return await _timed(one)


async def _with_aiohttp(url: str) -> float:
    connector = aiohttp.TCPConnector(limit=2 * STREAMS)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with session.post(url, json={"stream": True}) as response:
                async for chunk in response.content.iter_any():
                    for _ in chunk.splitlines():
                        pass

        return await _timed(one)


async def _timed(one: Callable[[], Awaitable[None]]) -> float:
    await one()  # a warm connection pool and imports
    start = time.process_time()
    await asyncio.gather(*(one() for _ in range(STREAMS)))
    return (time.process_time() - start) * 1000 / STREAMS


async def _wait_for(port: int) -> None:
    for _ in range(100):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise RuntimeError("the stand-in server did not start")


def run_part(_argv: list[str]) -> None:
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,))
    server.start()
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(_wait_for(port))
        for _ in range(2):
            for name, read in (("httpx", _with_httpx), ("aiohttp", _with_aiohttp)):
                ms = asyncio.run(read(url))
                print(f"{name:8} {ms:.2f} ms of CPU per answer of {CHUNKS} chunks")
    finally:
        server.terminate()
        server.join()
