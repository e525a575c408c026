"""Token counts when no provider reported any: about four characters of text per token.

The offline stand-in has no tokenizer, and some OpenAI-compatible servers ignore
``include_usage``; a budget in tokens still has to count something for them. The rule is the
one ``AUTO_COMPACT_TOKENS`` already uses (JSON characters / 4), applied to what the request
sent (messages and tool schemas) and what came back, and the result is always marked
``estimated`` so no report can pass it off as the provider's own count.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    SystemMessage,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)

CHARS_PER_TOKEN = 4


def _tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)  # a non-empty text is at least one token


def _chars(message: ChatMessage) -> int:
    if isinstance(message, SystemMessage | UserMessage):
        return len(message.text)
    if isinstance(message, ToolResult):
        return len(message.content) + len(message.tool_call_id)
    return len(message.text) + sum(
        len(call.name) + len(json.dumps(call.arguments, ensure_ascii=False))
        for call in message.tool_calls
    )


def estimate_usage(
    messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], reply: AssistantMessage
) -> Usage:
    """An estimate of one request: what it sent (messages and tools) in, ``reply`` out."""
    sent = sum(map(_chars, messages)) + sum(
        len(tool.name) + len(tool.description) + len(json.dumps(tool.parameters)) for tool in tools
    )
    return Usage(
        input_tokens=_tokens(sent),
        output_tokens=_tokens(_chars(reply)),
        cached_tokens=0,
        cache_write_tokens=0,
        estimated=True,
    )
