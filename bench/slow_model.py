"""A stand-in model that streams slowly, for the ``concurrent_turns`` benchmark.

An OpenAI-compatible Chat Completions server on 127.0.0.1 whose every answer streams a word
every ``seconds / WORDS`` seconds, so a turn holds its model call open for ``seconds`` as a
real model does. ``GET /stats`` says how many calls are in flight, the most there ever were,
and how many have finished: the benchmark waits on it for "N turns at once". Run it in its own
process (``python -m bench.slow_model SECONDS`` prints its URL) so its work does not share the
measuring process's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from aiohttp import web

from bench.model_standin import usage_frame

WORDS = 20


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-slow",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "slow-standin",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n".encode()


class SlowModel:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.in_flight = 0
        self.most = 0
        self.started = 0
        self.finished = 0
        self.failed = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_get("/stats", self._stats)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        server = site._server
        assert server is not None
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "in_flight": self.in_flight,
                "most": self.most,
                "started": self.started,
                "finished": self.finished,
                "failed": self.failed,
            }
        )

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.in_flight += 1
        self.started += 1
        self.most = max(self.most, self.in_flight)
        try:
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            await response.write(_chunk({"role": "assistant", "content": ""}))
            for i in range(WORDS):
                await asyncio.sleep(self.seconds / WORDS)
                await response.write(_chunk({"content": f"word{i} "}))
            await response.write(_chunk({}, "stop"))
            usage = usage_frame(len(body) // 4, 2 * WORDS, model="slow-standin")
            await response.write(usage.encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            self.finished += 1
            return response
        except (ConnectionError, asyncio.CancelledError):
            self.failed += 1
            raise
        finally:
            self.in_flight -= 1


async def _serve_forever(seconds: float) -> None:
    model = SlowModel(seconds)
    await model.start()
    print(model.url, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await model.stop()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0))
