"""Model providers over aiohttp: one neutral format, one protocol, three implementations.

base          the neutral conversation, stream events, the ``ModelProvider`` protocol
uimessages    stored UIMessages -> neutral messages, and the tool parts the loop stores
sse           server-sent events from lines
streaming     one streamed POST: timeouts, retries, faults -> ``ModelProviderError``
openai        Chat Completions (any OpenAI-compatible server)
anthropic     the Anthropic Messages API
offline       the deterministic stand-in
estimate      token counts when no provider reported any (marked estimated)
"""

from core.providers.anthropic import AnthropicProvider
from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    EventStream,
    Finish,
    ModelProvider,
    StopReason,
    StreamEvent,
    SystemMessage,
    TextDelta,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)
from core.providers.estimate import estimate_usage
from core.providers.offline import OFFLINE_LABEL, OfflineProvider
from core.providers.openai import OpenAIProvider
from core.providers.streaming import DEFAULT_TIMEOUT, HttpOptions, RetryPolicy, Timeouts
from core.providers.uimessages import (
    step_start_part,
    text_part,
    tool_call_part,
    tool_error_part,
    tool_output_part,
    ui_to_chat,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "OFFLINE_LABEL",
    "AnthropicProvider",
    "AssistantMessage",
    "ChatMessage",
    "EventStream",
    "Finish",
    "HttpOptions",
    "ModelProvider",
    "OfflineProvider",
    "OpenAIProvider",
    "RetryPolicy",
    "StopReason",
    "StreamEvent",
    "SystemMessage",
    "TextDelta",
    "Timeouts",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "Usage",
    "UserMessage",
    "estimate_usage",
    "step_start_part",
    "text_part",
    "tool_call_part",
    "tool_error_part",
    "tool_output_part",
    "ui_to_chat",
]
