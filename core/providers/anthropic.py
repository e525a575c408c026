"""The Anthropic Messages API (``POST /v1/messages``), streamed.

The conversation is reshaped to the API's rules: system prompts go to the top-level ``system``
field, tool results travel as ``tool_result`` blocks of a user message, and consecutive messages
of one role are merged (results of parallel calls and the next user text share one user turn).
A tool call is yielded at its ``content_block_stop``, when its ``input_json_delta`` fragments
form a whole JSON object. Event types this module does not know are skipped, as the API's
versioning policy asks; ``message_stop`` is the only proof that a stream is complete.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import (
    ModelProviderBadResponse,
    ModelProviderError,
    ModelProviderRateLimited,
    ModelProviderRejected,
    ModelProviderUnavailable,
)
from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    EventStream,
    Finish,
    JsonObject,
    StopReason,
    SystemMessage,
    TextDelta,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
    check_tool_choice,
)
from core.providers.sse import ServerSentEvent
from core.providers.streaming import HttpOptions, SseStreamer, parse_json_object

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_MODEL = "claude-sonnet-4-5"
API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096

_STOP_REASONS: dict[str, StopReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
}

# Error types of the in-stream ``error`` event, by what a caller can do about them.
_STREAM_ERRORS: dict[str, type[ModelProviderError]] = {
    "overloaded_error": ModelProviderUnavailable,
    "api_error": ModelProviderUnavailable,
    "rate_limit_error": ModelProviderRateLimited,
    "invalid_request_error": ModelProviderRejected,
    "authentication_error": ModelProviderRejected,
    "permission_error": ModelProviderRejected,
    "not_found_error": ModelProviderRejected,
    "request_too_large": ModelProviderRejected,
}


def _blocks(message: UserMessage | ToolResult | AssistantMessage) -> tuple[str, list[JsonObject]]:
    if isinstance(message, UserMessage):
        return "user", [{"type": "text", "text": message.text}] if message.text else []
    if isinstance(message, ToolResult):
        block: JsonObject = {
            "type": "tool_result",
            "tool_use_id": message.tool_call_id,
            "content": message.content,
        }
        if message.is_error:
            block["is_error"] = True
        return "user", [block]
    # The API refuses empty text blocks, which an interrupted step can leave behind.
    blocks: list[JsonObject] = [{"type": "text", "text": message.text}] if message.text else []
    blocks.extend(
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        for call in message.tool_calls
    )
    return "assistant", blocks


def request_body(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec],
    *,
    model: str,
    max_tokens: int,
    tool_choice: str | None,
) -> JsonObject:
    system = [m.text for m in messages if isinstance(m, SystemMessage)]
    turns: list[JsonObject] = []
    for message in messages:
        if isinstance(message, SystemMessage):
            continue
        role, blocks = _blocks(message)
        if not blocks:
            continue
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    body: JsonObject = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": turns,
        "stream": True,
    }
    if system:
        body["system"] = "\n\n".join(system)
    if tools:
        body["tools"] = [
            {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}
            for tool in tools
        ]
    if tool_choice is not None:
        body["tool_choice"] = {"type": "tool", "name": tool_choice}
    return body


@dataclass
class _ToolBlock:
    id: str
    name: str
    initial_input: JsonObject
    json_parts: list[str] = field(default_factory=list)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _index(data: JsonObject) -> int:
    index = data.get("index")
    return index if isinstance(index, int) else -1


def _obj(value: Any) -> JsonObject:
    return value if isinstance(value, dict) else {}


_USAGE_KEYS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)


def _usage(counts: dict[str, int]) -> Usage:
    """The API's ``input_tokens`` leaves out the prompt tokens read from or written to the
    cache; ours counts every token the model read, so the three are added. A request that sent
    no ``cache_*`` field (an older API version, a compatible server) used no cache."""
    uncached = counts.get("input_tokens")
    written = counts.get("cache_creation_input_tokens", 0 if uncached is not None else None)
    read = counts.get("cache_read_input_tokens", 0 if uncached is not None else None)
    total = None
    if uncached is not None and written is not None and read is not None:
        total = uncached + written + read
    return Usage(total, counts.get("output_tokens"), read, written)


def _count_usage(counts: dict[str, int], raw: Any) -> None:
    """``message_start`` carries the first counts and every ``message_delta`` the cumulative
    ones it knows (output always; the input fields only in newer API versions)."""
    usage = _obj(raw)
    for key in _USAGE_KEYS:
        value = _int(usage.get(key))
        if value is not None:
            counts[key] = value


class AnthropicProvider:
    def __init__(
        self,
        *,
        api_key: str,
        base_url: str = DEFAULT_BASE_URL,
        default_model: str = DEFAULT_MODEL,
        name: str = "anthropic",
        max_tokens: int = DEFAULT_MAX_TOKENS,
        http: HttpOptions | None = None,
    ) -> None:
        self.name = name
        self.default_model = default_model
        self.max_tokens = max_tokens
        self.url = base_url.rstrip("/") + "/v1/messages"
        self._headers = {
            "accept": "text/event-stream",
            "anthropic-version": API_VERSION,
            "x-api-key": api_key,
        }
        self._http = SseStreamer(name, http)

    async def aclose(self) -> None:
        await self._http.aclose()

    def stream(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
        *,
        tool_choice: str | None = None,
        model: str | None = None,
    ) -> EventStream:
        check_tool_choice(tools, tool_choice)
        body = request_body(
            messages,
            tools,
            model=model or self.default_model,
            max_tokens=self.max_tokens,
            tool_choice=tool_choice,
        )
        return self._http.stream(self.url, self._headers, body, self._parse)

    def _bad(self, message: str) -> ModelProviderBadResponse:
        return ModelProviderBadResponse(f"{self.name}: {message}", provider=self.name)

    def _stream_error(self, data: JsonObject) -> ModelProviderError:
        error = data.get("error")
        kind = str(error.get("type", "")) if isinstance(error, dict) else ""
        detail = str(error.get("message", "")) if isinstance(error, dict) else str(error)
        cls = _STREAM_ERRORS.get(kind, ModelProviderBadResponse)
        return cls(f"{self.name}: {kind or 'error'} in stream: {detail}", provider=self.name)

    def _tool_call(self, block: _ToolBlock) -> ToolCall:
        raw = "".join(block.json_parts)
        arguments = (
            parse_json_object(raw, provider=self.name, what=f"the input of tool {block.name!r}")
            if raw
            else block.initial_input
        )
        return ToolCall(block.id, block.name, arguments)

    async def _parse(self, events: AsyncIterator[ServerSentEvent]) -> EventStream:
        tools: dict[int, _ToolBlock] = {}
        counts: dict[str, int] = {}
        reason: str | None = None
        async for sse in events:
            data = parse_json_object(sse.data, provider=self.name, what="a stream event")
            kind = sse.event or data.get("type")
            if kind == "message_start":
                _count_usage(counts, _obj(data.get("message")).get("usage"))
            elif kind == "content_block_start":
                block = data.get("content_block")
                index = data.get("index")
                if not isinstance(block, dict) or not isinstance(index, int):
                    raise self._bad(f"malformed content_block_start: {sse.data[:200]!r}")
                if block.get("type") == "tool_use":
                    initial = block.get("input")
                    tools[index] = _ToolBlock(
                        str(block.get("id", f"toolu_{index}")),
                        str(block.get("name", "")),
                        initial if isinstance(initial, dict) else {},
                    )
                elif block.get("type") == "text" and block.get("text"):
                    yield TextDelta(str(block["text"]))
            elif kind == "content_block_delta":
                delta = data.get("delta")
                if not isinstance(delta, dict):
                    raise self._bad(f"malformed content_block_delta: {sse.data[:200]!r}")
                if delta.get("type") == "text_delta" and delta.get("text"):
                    yield TextDelta(str(delta["text"]))
                elif delta.get("type") == "input_json_delta":
                    tool = tools.get(_index(data))
                    if tool is None:
                        raise self._bad(f"input_json_delta for no tool block: {sse.data[:200]!r}")
                    tool.json_parts.append(str(delta.get("partial_json", "")))
            elif kind == "content_block_stop":
                tool = tools.pop(_index(data), None)
                if tool is not None:
                    yield self._tool_call(tool)
            elif kind == "message_delta":
                stop_reason = _obj(data.get("delta")).get("stop_reason")
                if stop_reason:
                    reason = str(stop_reason)
                _count_usage(counts, data.get("usage"))
            elif kind == "message_stop":
                yield _usage(counts)
                yield Finish(_STOP_REASONS.get(reason or "", "other"), reason)
                return
            elif kind == "error":
                raise self._stream_error(data)
        raise self._bad("the stream ended before message_stop")
