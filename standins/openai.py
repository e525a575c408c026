"""A stand-in model speaking OpenAI's Chat Completions streaming wire format.

The builders make what a real server streams: ``chat.completion.chunk`` objects as SSE
``data:`` lines, tool calls spread over fragments keyed by ``index``, the usage chunk that
``stream_options.include_usage`` asks for (``choices: []``), then ``data: [DONE]``.

``OpenAIStandIn`` answers ``/v1/chat/completions`` from a script or a function (see
``standins.scripted``). Three configurations of it are used often enough to live here:
``GatedModel`` (tests hold a turn open until they open a gate), ``SoakModel`` (the soak's:
random latencies, shell tool calls, timeouts and cut streams at exact shares) and
``SlowModel`` (the benchmark's: every answer streams for a fixed time, ``GET /stats`` says how
many are in flight). ``python -m standins.openai SECONDS`` runs the slow one in a
process of its own and prints its URL.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from standins.faults import FaultSchedule
from standins.scripted import (
    JsonReply,
    RecordedRequest,
    Reply,
    ScriptedServer,
    SseReply,
    sse_frame,
)
from standins.server import run_forever

DONE = "data: [DONE]\n\n"
Calls = Sequence[tuple[str, str, dict[str, Any]]]  # (call id, tool name, arguments)


def chunk(
    delta: Mapping[str, Any], finish_reason: str | None = None, *, model: str = "fake-model"
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": dict(delta), "finish_reason": finish_reason}],
    }


def usage_chunk(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = 0,
    *,
    model: str = "fake-model",
) -> dict[str, Any]:
    """The last chunk ``include_usage`` asks for, as OpenAI sends it: no choices, and the
    cached part of the prompt in ``prompt_tokens_details`` (``cached_tokens=None``: a
    compatible server that sends no details)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens, "audio_tokens": 0}
        usage["completion_tokens_details"] = {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        }
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [],
        "usage": usage,
    }


def text_frames(*pieces: str, finish_reason: str = "stop") -> list[str]:
    """A streamed text answer without its terminator (the usage chunk and ``[DONE]``)."""
    frames = [sse_frame(chunk({"role": "assistant", "content": "", "refusal": None}))]
    frames += [sse_frame(chunk({"content": piece})) for piece in pieces]
    frames.append(sse_frame(chunk({}, finish_reason)))
    return frames


def ending(prompt_tokens: int, completion_tokens: int) -> list[str]:
    """What ends every stream: the usage chunk and ``[DONE]``."""
    return [sse_frame(usage_chunk(prompt_tokens, completion_tokens)), DONE]


def text_reply(*pieces: str, usage: tuple[int, int] = (12, 7)) -> SseReply:
    return SseReply([*text_frames(*pieces), *ending(*usage)])


def tool_call_frames(
    calls: Calls, *, text: str = "", finish_reason: str = "tool_calls", fragments: int = 3
) -> list[str]:
    """Tool calls as a real server streams them: id and name first, then the arguments JSON in
    ``fragments`` pieces, the calls' fragments interleaved so only ``index`` can reassemble them."""
    frames = [sse_frame(chunk({"role": "assistant", "content": None}))]
    if text:
        frames.append(sse_frame(chunk({"content": text})))
    pieces: list[list[str]] = []
    for index, (call_id, name, arguments) in enumerate(calls):
        head = {"index": index, "id": call_id, "type": "function"}
        head["function"] = {"name": name, "arguments": ""}
        frames.append(sse_frame(chunk({"tool_calls": [head]})))
        raw = json.dumps(arguments)
        size = -(-len(raw) // fragments)
        pieces.append([raw[i : i + size] for i in range(0, len(raw), size)])
    for round_ in range(max(map(len, pieces), default=0)):
        for index, parts in enumerate(pieces):
            if round_ < len(parts):
                fragment = {"index": index, "function": {"arguments": parts[round_]}}
                frames.append(sse_frame(chunk({"tool_calls": [fragment]})))
    frames.append(sse_frame(chunk({}, finish_reason)))
    return frames


def tool_call_reply(calls: Calls, *, text: str = "", finish_reason: str = "tool_calls") -> SseReply:
    frames = tool_call_frames(calls, text=text, finish_reason=finish_reason)
    return SseReply([*frames, *ending(30, 11)])


def error_reply(
    status: int, message: str = "fake failure", headers: Mapping[str, str] | None = None
) -> JsonReply:
    body = {"error": {"message": message, "type": "fake_error", "param": None, "code": None}}
    return JsonReply(status, body, headers or {})


def after_tool(body: Any) -> bool:
    """The request continues a round whose tools have answered (its last message a result)."""
    messages = body.get("messages") or [] if isinstance(body, dict) else []
    return bool(messages) and messages[-1].get("role") == "tool"


class OpenAIStandIn(ScriptedServer):
    """The Chat Completions endpoint; point ``OPENAI_BASE_URL`` at ``base_url``."""

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


class GatedModel(OpenAIStandIn):
    """Answers "answer N" (N counting from 1) once the gate is open; records concurrency.

    ``command``: a request whose conversation does not end in a tool result is answered at once
    with a call of the ``shell`` tool running it (so a turn changes its sandbox, then waits at
    the gate for its final answer). ``early``: text streamed before waiting at the gate.
    ``dropped`` counts answers the client no longer took (it stopped the turn and closed the
    connection).
    """

    def __init__(self, *, early: str = "", command: str | None = None) -> None:
        super().__init__(self._reply)
        self.early = early
        self.command = command
        self.gate = asyncio.Event()
        self.arrived = asyncio.Event()

    def release(self) -> None:
        self.gate.set()
        super().release()

    def _reply(self, request: RecordedRequest, number: int) -> Reply:
        if self.command and not after_tool(request.body):
            calls = [(f"call_{number}", "shell", {"command": self.command})]
            return SseReply([*tool_call_frames(calls), *ending(5, 2)], split=False)
        pieces = (self.early, f"answer {number}") if self.early else (f"answer {number}",)
        frames = [*text_frames(*pieces), *ending(5, 2)]
        gate_at = 2 if self.early else 1
        return SseReply(frames, split=False, gate=self.gate, gate_at=gate_at, arrived=self.arrived)


# -- the soak's model --------------------------------------------------------------------------

_TAG = re.compile(r"\[(t\d+)\]")


@dataclass(frozen=True)
class ModelFaults:
    timeout: float = 0.0  # share of requests that go silent
    cut: float = 0.0  # share of requests whose stream is cut mid-answer
    tool: float = 0.0  # share of first rounds that call the shell tool
    silence_seconds: float = 10.0  # how long a "timeout" stays silent


def conversation_tag(body: Any) -> str:
    """The ``[t…]`` tag the soak's load generator puts in each thread's messages."""
    for message in body.get("messages", []) if isinstance(body, dict) else []:
        found = _TAG.search(str(message.get("content")))
        if found:
            return found.group(1)
    return "untagged"


class SoakModel(OpenAIStandIn):
    """The soak's model: answers after a random 50-500 ms, streaming the answer in pieces; on
    some first rounds it calls the ``shell`` tool instead (so turns change their sandbox and
    take a second round); and it misbehaves at exactly the shares it is given, spread evenly: a
    request that goes silent for longer than the replicas' ``MODEL_TIMEOUT_SECONDS`` (a
    timeout), a stream that is cut mid-answer. Requests are counted in flight per conversation
    (``conversation_tag``): ``overlapping()`` must stay empty."""

    def __init__(self, faults: ModelFaults, *, seed: int = 0) -> None:
        super().__init__(self._reply, key=conversation_tag, record=False)
        self.faults = faults
        self.injected: Counter[str] = Counter()
        self._random = random.Random(seed)  # latencies and tool calls
        self._faults = FaultSchedule(timeout=faults.timeout, cut=faults.cut)

    def _reply(self, request: RecordedRequest, number: int) -> Reply:
        messages = request.body.get("messages", [])
        tag = conversation_tag(request.body)
        first = sse_frame(chunk({"role": "assistant", "content": ""}, model="standin"))
        fault = self._faults.next()
        if fault == "timeout":
            self.injected["timeout"] += 1
            return SseReply([first], split=False, linger=self.faults.silence_seconds)
        latency = self._random.uniform(0.05, 0.5)
        if fault == "cut":
            self.injected["cut"] += 1
            cut = sse_frame(chunk({"content": f"({tag}) this answer is cut "}, model="standin"))
            return SseReply([first, cut], cut=True, split=False, pauses={1: latency})
        if not after_tool(request.body) and self._random.random() < self.faults.tool:
            self.injected["tool"] += 1
            command = f"echo {tag} >> notes.txt; wc -l notes.txt"
            call = {
                "index": 0,
                "id": f"call_{number}",
                "type": "function",
                "function": {"name": "shell", "arguments": json.dumps({"command": command})},
            }
            deltas: list[tuple[dict[str, Any], str | None]] = [
                ({"tool_calls": [call]}, None),
                ({}, "tool_calls"),
            ]
        else:
            words = f"({tag}) answered after {len(messages)} messages.".split(" ")
            deltas = [({"content": w + " "}, None) for w in words] + [({}, "stop")]
        frames = [sse_frame(chunk(delta, finish, model="standin")) for delta, finish in deltas]
        usage = sse_frame(usage_chunk(20 * len(messages), 12, model="standin"))
        return SseReply([first, *frames, usage, DONE], split=False, pauses={1: latency})


# -- the benchmark's slow model ----------------------------------------------------------------

WORDS = 20


class SlowModel(OpenAIStandIn):
    """Every answer streams a word every ``seconds / WORDS`` seconds, so a turn holds its model
    call open for ``seconds`` as a real model does. ``GET /stats`` says how many calls are in
    flight, the most there ever were, and how many finished or failed: the benchmark waits on
    it for "N turns at once"."""

    backlog = 2048
    path = "/v1/chat/completions"

    def __init__(self, seconds: float) -> None:
        super().__init__(self._reply, record=False)
        self.seconds = seconds
        self._sizes: dict[int, int] = {}

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_get("/stats", self._stats)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "in_flight": self.in_flight,
                "most": self.max_in_flight,
                "started": self.count,
                "finished": self.finished,
                "failed": self.dropped,
            }
        )

    def _reply(self, request: RecordedRequest, number: int) -> Reply:
        prompt = len(json.dumps(request.body)) // 4
        frames = [sse_frame(chunk({"role": "assistant", "content": ""}, model="slow-standin"))]
        frames += [
            sse_frame(chunk({"content": f"word{i} "}, model="slow-standin")) for i in range(WORDS)
        ]
        frames.append(sse_frame(chunk({}, "stop", model="slow-standin")))
        frames += [sse_frame(usage_chunk(prompt, 2 * WORDS, model="slow-standin")), DONE]
        pauses = dict.fromkeys(range(1, WORDS + 1), self.seconds / WORDS)
        return SseReply(frames, split=False, pauses=pauses)


if __name__ == "__main__":  # python -m standins.openai SECONDS: the slow model
    run_forever(SlowModel(float(sys.argv[1]) if len(sys.argv) > 1 else 5.0))
