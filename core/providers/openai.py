"""OpenAI-compatible Chat Completions (OpenAI, vLLM, Ollama, LiteLLM, ...), streamed.

Only the common subset every compatible server implements is sent: messages, tools,
``tool_choice`` and ``stream_options.include_usage`` (the usage then arrives in a last chunk
with no choices, before ``[DONE]``). Streamed tool calls arrive as fragments
keyed by ``index`` (the id and name in the first, the arguments JSON spread over the rest); a
call is yielded only once the choice finishes, because before that its arguments are not JSON.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import ModelProviderBadResponse, ModelProviderUnavailable
from core.providers.base import (
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
from core.providers.streaming import (
    HttpOptions,
    SseStreamer,
    error_detail,
    parse_json_object,
)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_MODEL = "gpt-4.1-mini"

_STOP_REASONS: dict[str, StopReason] = {
    "stop": "stop",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "length": "length",
}


def _message(message: ChatMessage) -> JsonObject | None:
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": message.text}
    if isinstance(message, UserMessage):
        return {"role": "user", "content": message.text}
    if isinstance(message, ToolResult):
        # Chat Completions has no error flag on tool messages; say it in the content.
        content = f"[error] {message.content}" if message.is_error else message.content
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": content}
    if not message.text and not message.tool_calls:
        return None
    out: JsonObject = {"role": "assistant", "content": message.text or None}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in message.tool_calls
        ]
    return out


def request_body(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec],
    *,
    model: str,
    tool_choice: str | None,
) -> JsonObject:
    body: JsonObject = {
        "model": model,
        "messages": [m for m in map(_message, messages) if m is not None],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                },
            }
            for tool in tools
        ]
    if tool_choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": tool_choice}}
    return body


@dataclass
class _PartialCall:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage(raw: JsonObject) -> Usage:
    """``prompt_tokens`` already counts the cached ones (``prompt_tokens_details``); servers
    that predate prompt caching send no details, and their cached count stays unknown."""
    details = raw.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(_int(raw.get("prompt_tokens")), _int(raw.get("completion_tokens")), cached)


class OpenAIProvider:
    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str = DEFAULT_BASE_URL,
        default_model: str = DEFAULT_MODEL,
        name: str = "openai",
        http: HttpOptions | None = None,
    ) -> None:
        self.name = name
        self.default_model = default_model
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._headers = {"accept": "text/event-stream"}
        if api_key:  # local servers (vLLM, Ollama) may run without one
            self._headers["authorization"] = f"Bearer {api_key}"
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
            messages, tools, model=model or self.default_model, tool_choice=tool_choice
        )
        return self._http.stream(self.url, self._headers, body, self._parse)

    def _bad(self, message: str) -> ModelProviderBadResponse:
        return ModelProviderBadResponse(f"{self.name}: {message}", provider=self.name)

    def _finish_calls(self, calls: dict[int, _PartialCall]) -> list[ToolCall]:
        done = []
        for index in sorted(calls):
            partial = calls[index]
            if not partial.name:
                raise self._bad(f"tool call #{index} streamed without a function name")
            arguments = parse_json_object(
                "".join(partial.arguments) or "{}",
                provider=self.name,
                what=f"the arguments of tool call {partial.name!r}",
            )
            done.append(ToolCall(partial.id or f"call_{index}", partial.name, arguments))
        calls.clear()
        return done

    async def _parse(self, events: AsyncIterator[ServerSentEvent]) -> EventStream:
        calls: dict[int, _PartialCall] = {}
        called = False
        reason: str | None = None
        usage: Usage | None = None
        async for sse in events:
            if sse.data.strip() == "[DONE]":
                for call in self._finish_calls(calls):
                    called = True
                    yield call
                # A server that ignores include_usage sends no usage chunk: counts unknown.
                yield usage or Usage()
                # A forced tool call finishes with "stop"; report what the caller must act on.
                stop = _STOP_REASONS.get(reason or "", "other")
                yield Finish("tool_calls" if called else stop, reason)
                return
            chunk = parse_json_object(sse.data, provider=self.name, what="a stream chunk")
            if chunk.get("error"):
                raise ModelProviderUnavailable(
                    f"{self.name}: error in stream: {error_detail(sse.data.encode())}",
                    provider=self.name,
                )
            raw_usage = chunk.get("usage")
            if isinstance(raw_usage, dict):  # the last one wins (some servers send running totals)
                usage = _usage(raw_usage)
            choices = chunk.get("choices") or []
            if not isinstance(choices, list):
                raise self._bad(f"'choices' is not a list: {sse.data[:200]!r}")
            for choice in choices:
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                delta = choice.get("delta") or {}
                if not isinstance(delta, dict):
                    raise self._bad(f"'delta' is not an object: {sse.data[:200]!r}")
                text = delta.get("content") or delta.get("refusal")
                if isinstance(text, str) and text:
                    yield TextDelta(text)
                for fragment in delta.get("tool_calls") or []:
                    self._add_fragment(calls, fragment, sse.data)
                if choice.get("finish_reason"):
                    reason = str(choice["finish_reason"])
                    for call in self._finish_calls(calls):
                        called = True
                        yield call
        raise self._bad("the stream ended before [DONE]")

    def _add_fragment(self, calls: dict[int, _PartialCall], fragment: Any, raw: str) -> None:
        if not isinstance(fragment, dict):
            raise self._bad(f"a tool call fragment is not an object: {raw[:200]!r}")
        index = fragment.get("index", len(calls))
        if not isinstance(index, int):
            raise self._bad(f"a tool call fragment has no integer index: {raw[:200]!r}")
        partial = calls.setdefault(index, _PartialCall())
        if isinstance(fragment.get("id"), str) and fragment["id"]:
            partial.id = fragment["id"]
        function = fragment.get("function") or {}
        if not isinstance(function, dict):
            raise self._bad(f"a tool call fragment's function is not an object: {raw[:200]!r}")
        if isinstance(function.get("name"), str) and function["name"]:
            partial.name = function["name"]
        if isinstance(function.get("arguments"), str):
            partial.arguments.append(function["arguments"])
