"""A stand-in model for the soak: an OpenAI-compatible Chat Completions server on 127.0.0.1.

It answers after a random 50-500 ms, streaming the answer in pieces; on some first rounds it
calls the ``shell`` tool instead (so turns change their sandbox and take a second round); and
it misbehaves at exactly the shares it is given, spread evenly (``FaultSchedule``): a request
that goes silent for longer than the replicas' ``MODEL_TIMEOUT_SECONDS`` (a timeout), a
stream that is cut mid-answer. Every request names its conversation (the ``[t…]`` tag the
load generator puts in each thread's messages), so the server knows how many requests of one
conversation are in flight at once: the soak's "never two model calls at once for one
session" is counted here, where the calls arrive.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bot.standin import FaultSchedule

_TAG = re.compile(r"\[(t\d+)\]")


@dataclass(frozen=True)
class ModelFaults:
    timeout: float = 0.0  # share of requests that go silent
    cut: float = 0.0  # share of requests whose stream is cut mid-answer
    tool: float = 0.0  # share of first rounds that call the shell tool
    silence_seconds: float = 10.0  # how long a "timeout" stays silent


@dataclass
class ModelStats:
    requests: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)
    max_in_flight: Counter[str] = field(default_factory=Counter)  # per conversation

    @property
    def overlapping(self) -> dict[str, int]:
        """Conversations that ever had two requests in flight at once (must be empty)."""
        return {tag: n for tag, n in self.max_in_flight.items() if n > 1}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    body = {
        "id": "chatcmpl-standin",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "standin",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body)}\n\n"


def usage_frame(prompt: int, completion: int, *, model: str = "standin") -> str:
    """The last chunk ``stream_options.include_usage`` asks for, as OpenAI sends it."""
    body = {
        "id": "chatcmpl-standin",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
    }
    return f"data: {json.dumps(body)}\n\n"


async def _wait(request: web.Request, seconds: float) -> None:
    """Sleep, but stop when the client hangs up: a call whose replica gave up on it (a model
    timeout) or died is no longer in flight, whatever this server would have done next."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        if request.transport is None or request.transport.is_closing():
            raise ConnectionResetError("the client went away")
        await asyncio.sleep(min(left, 0.02))


class ModelStandIn:
    def __init__(self, faults: ModelFaults, *, seed: int = 0) -> None:
        self.faults = faults
        self.stats = ModelStats()
        self.url = ""
        self._random = random.Random(seed)  # latencies and tool calls
        self._faults = FaultSchedule(timeout=faults.timeout, cut=faults.cut)
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages = body.get("messages", [])
        tag = next(
            (m.group(1) for msg in messages if (m := _TAG.search(str(msg.get("content"))))),
            "untagged",
        )
        self.stats.requests += 1
        self.stats.in_flight[tag] += 1
        self.stats.max_in_flight[tag] = max(
            self.stats.max_in_flight[tag], self.stats.in_flight[tag]
        )
        try:
            return await self._answer(request, messages, tag)
        except ConnectionError:  # the replica stopped the turn or died
            return web.StreamResponse()
        finally:
            self.stats.in_flight[tag] -= 1

    async def _answer(
        self, request: web.Request, messages: list[dict[str, Any]], tag: str
    ) -> web.StreamResponse:
        fault = self._faults.next()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(_chunk({"role": "assistant", "content": ""}).encode())
        if fault == "timeout":
            self.stats.injected["timeout"] += 1
            await _wait(request, self.faults.silence_seconds)
            return response
        await _wait(request, self._random.uniform(0.05, 0.5))
        if fault == "cut":
            self.stats.injected["cut"] += 1
            await response.write(_chunk({"content": f"({tag}) this answer is cut "}).encode())
            assert request.transport is not None
            request.transport.close()
            return response
        first_round = not messages or messages[-1].get("role") != "tool"
        if first_round and self._random.random() < self.faults.tool:
            self.stats.injected["tool"] += 1
            call = {
                "index": 0,
                "id": f"call_{self.stats.requests}",
                "type": "function",
                "function": {
                    "name": "shell",
                    "arguments": json.dumps(
                        {"command": f"echo {tag} >> notes.txt; wc -l notes.txt"}
                    ),
                },
            }
            frames = [_chunk({"tool_calls": [call]}), _chunk({}, "tool_calls")]
        else:
            words = f"({tag}) answered after {len(messages)} messages.".split(" ")
            frames = [_chunk({"content": w + " "}) for w in words] + [_chunk({}, "stop")]
        for frame in [*frames, usage_frame(20 * len(messages), 12), "data: [DONE]\n\n"]:
            await response.write(frame.encode())
        await response.write_eof()
        return response
