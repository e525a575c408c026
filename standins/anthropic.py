"""A stand-in model speaking the Anthropic Messages API streaming wire format.

``AnthropicStandIn`` is a ``ScriptedServer`` (see ``standins.scripted``); the builders make
what the API streams: ``message_start`` (with the message's usage), ``content_block_start/
delta/stop`` (``text_delta``, ``input_json_delta``), ``ping``, ``message_delta`` with the stop
reason and usage, ``message_stop``, and ``error``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from standins.scripted import JsonReply, ScriptedServer, SseReply, sse_frame


class AnthropicStandIn(ScriptedServer):
    """The Messages endpoint; point ``ANTHROPIC_BASE_URL`` at ``base_url``."""

    @property
    def base_url(self) -> str:
        return self.url


def event(kind: str, **fields: Any) -> str:
    return sse_frame({"type": kind, **fields}, event=kind)


def message_start(input_tokens: int = 15, *, cache_read: int = 0, cache_write: int = 0) -> str:
    """``input_tokens`` is the uncached part of the prompt, as the API counts it; the cached
    parts come in their own fields."""
    message: dict[str, Any] = {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "fake-model",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": cache_write,
            "cache_read_input_tokens": cache_read,
            "output_tokens": 1,
            "service_tier": "standard",
        },
    }
    return event("message_start", message=message)


def text_block(index: int, *pieces: str) -> list[str]:
    frames = [event("content_block_start", index=index, content_block={"type": "text", "text": ""})]
    frames.append(event("ping"))
    frames += [
        event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
        for piece in pieces
    ]
    frames.append(event("content_block_stop", index=index))
    return frames


def tool_block(index: int, call_id: str, name: str, arguments: dict[str, Any]) -> list[str]:
    block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
    frames = [event("content_block_start", index=index, content_block=block)]
    raw = json.dumps(arguments)
    size = max(1, -(-len(raw) // 3))
    frames.append(
        event(
            "content_block_delta",
            index=index,
            delta={"type": "input_json_delta", "partial_json": ""},
        )
    )
    frames += [
        event(
            "content_block_delta",
            index=index,
            delta={"type": "input_json_delta", "partial_json": raw[i : i + size]},
        )
        for i in range(0, len(raw), size)
    ]
    frames.append(event("content_block_stop", index=index))
    return frames


def message_end(
    stop_reason: str, output_tokens: int = 9, *, input_usage: dict[str, int] | None = None
) -> list[str]:
    """``message_delta`` carries cumulative counts: always the output, and in newer API
    versions the input fields again (``input_usage``)."""
    delta = {"stop_reason": stop_reason, "stop_sequence": None}
    usage = {**(input_usage or {}), "output_tokens": output_tokens}
    return [event("message_delta", delta=delta, usage=usage), event("message_stop")]


def text_reply(*pieces: str) -> SseReply:
    return SseReply([message_start(), *text_block(0, *pieces), *message_end("end_turn")])


def tool_use_reply(calls: Sequence[tuple[str, str, dict[str, Any]]], *, text: str = "") -> SseReply:
    frames = [message_start()]
    index = 0
    if text:
        frames += text_block(0, text)
        index = 1
    for offset, (call_id, name, arguments) in enumerate(calls):
        frames += tool_block(index + offset, call_id, name, arguments)
    return SseReply([*frames, *message_end("tool_use")])


def error_reply(
    status: int,
    kind: str = "api_error",
    message: str = "fake failure",
    headers: Mapping[str, str] | None = None,
) -> JsonReply:
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JsonReply(status, body, headers or {})
