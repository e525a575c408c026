"""A local OpenAI-compatible Chat Completions server speaking the real streaming wire format.

``FakeOpenAI`` is a ``ScriptedServer``; the functions here build the replies a real server
sends: ``chat.completion.chunk`` objects as SSE ``data:`` lines, tool calls spread over
fragments keyed by ``index``, the usage chunk (``choices: []``), then ``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tests.providers_fixtures import JsonReply, ScriptedServer, SseReply, sse_frame

DONE = "data: [DONE]\n\n"


class FakeOpenAI(ScriptedServer):
    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def chunk(delta: Mapping[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "fake-model",
        "choices": [{"index": 0, "delta": dict(delta), "finish_reason": finish_reason}],
    }


def usage_chunk(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0
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
        "model": "fake-model",
        "choices": [],
        "usage": usage,
    }


def text_frames(*pieces: str, finish_reason: str = "stop") -> list[str]:
    """A streamed text answer without its terminator (the usage chunk and ``[DONE]``)."""
    frames = [sse_frame(chunk({"role": "assistant", "content": "", "refusal": None}))]
    frames += [sse_frame(chunk({"content": piece})) for piece in pieces]
    frames.append(sse_frame(chunk({}, finish_reason)))
    return frames


def text_reply(*pieces: str, usage: tuple[int, int] = (12, 7)) -> SseReply:
    return SseReply([*text_frames(*pieces), sse_frame(usage_chunk(*usage)), DONE])


def tool_call_frames(
    calls: Sequence[tuple[str, str, dict[str, Any]]],
    *,
    text: str = "",
    finish_reason: str = "tool_calls",
    fragments: int = 3,
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


def tool_call_reply(
    calls: Sequence[tuple[str, str, dict[str, Any]]],
    *,
    text: str = "",
    finish_reason: str = "tool_calls",
) -> SseReply:
    frames = tool_call_frames(calls, text=text, finish_reason=finish_reason)
    return SseReply([*frames, sse_frame(usage_chunk(30, 11)), DONE])


def error_reply(
    status: int, message: str = "fake failure", headers: Mapping[str, str] | None = None
) -> JsonReply:
    body = {"error": {"message": message, "type": "fake_error", "param": None, "code": None}}
    return JsonReply(status, body, headers or {})
